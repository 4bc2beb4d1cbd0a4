// The playground: one column per server (this one, then each --playground-peer, reached through
// this server), the same request sent to all at once, streamed into each column as it arrives.
// Plain JavaScript, no build step, nothing loaded from elsewhere.
"use strict";

const params = new URLSearchParams(location.search);
const POLL_MS = Number(params.get("poll_ms")) || 1000; // how often each light is refreshed
const TIMELINE_POLL_MS = 700; // how often a streaming answer's timeline is redrawn
const KEY_STORAGE = "nanoserve-playground-key";
// The long shared prefix: fixed text, the same for every request and every server.
const PREFIX_SENTENCE =
  "A paged KV cache keeps the keys and values of every token in fixed-size blocks; " +
  "blocks whose tokens match an earlier request are shared instead of computed again. ";

const state = {
  config: { model: "", api_key_required: false, peers: [] },
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  maxModelLen: 0,
  mode: "chat",
  columns: [],
  isRunning: false,
};
window.playground = state; // for the curious (and the browser tests): the page's state

const $ = (selector, root = document) => root.querySelector(selector);

// ---- talking to the servers ----

function headers(extra = {}) {
  const h = { ...extra };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

class Server {
  // base: "" for this server, "/v1/playground/peers/NAME" for a peer (relayed by this server).
  constructor(name, base) {
    this.name = name;
    this.base = base;
  }
  url(path) {
    return this.base + path;
  }
}

async function askForKey(message) {
  const dialog = $("#key-dialog");
  $("#key-message").textContent = message || "";
  $("#api-key").value = "";
  dialog.showModal();
  await new Promise((resolve) => dialog.addEventListener("close", resolve, { once: true }));
  state.key = $("#api-key").value.trim();
  sessionStorage.setItem(KEY_STORAGE, state.key);
}

async function fetchModels() {
  // /v1/models: the model's name and context length; a 401 asks for the key (again).
  for (;;) {
    if (state.config.api_key_required && !state.key) await askForKey();
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      state.key = "";
      await askForKey("The server refused that key.");
      continue;
    }
    if (response.ok) {
      const card = (await response.json()).data[0];
      state.maxModelLen = card.max_model_len || 0;
      $("#model-name").textContent = card.id;
    }
    return;
  }
}

// ---- the status lights and the engine figures (/health and /metrics) ----

function parseMetrics(text) {
  // Prometheus text: the sum over label sets of each sample's value, by name.
  const sums = {};
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (match) sums[match[1]] = (sums[match[1]] || 0) + Number(match[3]);
  }
  return sums;
}

function setLight(column, lightState, label) {
  const light = $(".light", column.el);
  if (light.dataset.state !== lightState) column.lightHistory.push(lightState);
  light.dataset.state = lightState;
  $(".light-label", column.el).textContent = label || lightState;
}

async function poll(column) {
  let health;
  try {
    health = await fetch(column.server.url("/health"), { headers: headers(), cache: "no-store" });
  } catch (error) {
    setLight(column, "down", "down (no answer)");
    return;
  }
  if (health.status === 503) return setLight(column, "loading", "loading the model");
  if (health.status === 502 || health.status === 504) return setLight(column, "down", "down");
  if (!health.ok) return setLight(column, "down", `down (${health.status})`);
  try {
    const metrics = parseMetrics(await (await fetch(column.server.url("/metrics"), { headers: headers(), cache: "no-store" })).text());
    const running = metrics["vllm:num_requests_running"] || 0;
    const waiting = metrics["vllm:num_requests_waiting"] || 0;
    setFigure(column, "running", running);
    setFigure(column, "waiting", waiting);
    const usage = metrics["vllm:kv_cache_usage_perc"];
    setFigure(column, "kv", usage === undefined ? "–" : `${(100 * usage).toFixed(1)}%`);
    setFigure(column, "preemptions", metrics["vllm:num_preemptions_total"] ?? "–");
    setLight(column, running + waiting > 0 ? "busy" : "ready", running + waiting > 0 ? `busy (${running} running, ${waiting} waiting)` : "ready");
  } catch (error) {
    setLight(column, "ready", "ready (no /metrics)");
  }
}

function startPolling(column) {
  const tick = async () => {
    await poll(column);
    setTimeout(tick, POLL_MS);
  };
  tick();
}

function setFigure(column, name, value) {
  $(`.fig-${name}`, column.el).textContent = String(value);
}

// ---- columns ----

function addColumn(server) {
  const el = $("#column-template").content.firstElementChild.cloneNode(true);
  el.dataset.server = server.name;
  $(".server-name", el).textContent = server.name;
  $("#columns").append(el);
  const column = { server, el, lightHistory: [], messages: [], controller: null, requestId: null, result: null };
  state.columns.push(column);
  startPolling(column);
  return column;
}

function racingColumns() {
  return state.columns.filter((c) => c.server.base === "" || $(`#race-${c.server.name}`)?.checked);
}

// ---- building a request from the form ----

function number(id, parse = Number) {
  const value = $(`#${id}`).value.trim();
  return value === "" ? undefined : parse(value);
}

function fullPrefix() {
  let text = "";
  for (let i = 1; text.length < 12000; i++) text += `${i}. ${PREFIX_SENTENCE}`;
  return text;
}

async function measurePrefix() {
  // The long shared prefix: a few thousand tokens of fixed text, cut to at most half the
  // model's context (this server's tokenizer says how many characters a token holds here).
  const text = fullPrefix();
  let limit = state.maxModelLen ? Math.floor(state.maxModelLen / 2) : text.length; // ≥ 1 char a token
  try {
    const response = await fetch("/tokenize", { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify({ prompt: text, add_special_tokens: false }) });
    const count = (await response.json()).count;
    if (count > 0 && state.maxModelLen) limit = Math.floor((state.maxModelLen / 2) * (text.length / count));
  } catch (error) {
    // keep the cut that holds for any tokenizer
  }
  state.prefix = text.slice(0, Math.min(text.length, limit)) + "\n\n";
}

function longPrefix() {
  return state.prefix || "";
}

function samplingFields() {
  const body = {
    temperature: number("temperature"),
    top_p: number("top_p"),
    top_k: number("top_k", (v) => parseInt(v, 10)),
    min_p: number("min_p"),
    max_tokens: number("max_tokens", (v) => parseInt(v, 10)),
    seed: number("seed", (v) => parseInt(v, 10)),
    stream: true,
    stream_options: { include_usage: true },
  };
  // One a line; "\n" written out stands for a newline.
  const stop = $("#stop").value.split("\n").filter((s) => s !== "").map((s) => s.replaceAll("\\n", "\n"));
  if (stop.length) body.stop = stop;
  const schema = $("#json-schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
  }
  for (const key of Object.keys(body)) if (body[key] === undefined) delete body[key];
  return body;
}

function requestFor(column, text) {
  // [path, body] of one column's request: chat keeps each column's own conversation.
  const prefix = $("#long-prefix").checked ? longPrefix() : "";
  const body = { model: column.modelName, ...samplingFields() };
  if (state.mode === "completion") {
    const suffix = $("#fim-suffix").value;
    return ["/v1/completions", { ...body, prompt: prefix + text, ...(suffix ? { suffix } : {}) }];
  }
  const system = prefix + $("#system-prompt").value;
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...column.messages, { role: "user", content: text }];
  return ["/v1/chat/completions", { ...body, messages, chat_template_kwargs: { enable_thinking: $("#thinking").checked } }];
}

// ---- one streamed answer ----

function* sseEvents(buffer) {
  // Complete events in `buffer.text` (each ends with a blank line); the rest stays.
  let end;
  while ((end = buffer.text.indexOf("\n\n")) >= 0) {
    const event = buffer.text.slice(0, end);
    buffer.text = buffer.text.slice(end + 2);
    for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
  }
}

function chunkText(chunk) {
  const choice = (chunk.choices || [])[0];
  if (!choice) return "";
  if (choice.delta) return (choice.delta.reasoning_content || "") + (choice.delta.content || "");
  return choice.text || "";
}

async function runColumn(column, text) {
  const [path, body] = requestFor(column, text);
  const answer = $(".answer", column.el);
  const result = { text: "", requestId: null, usage: null, finishReason: null, error: null, t0: performance.now(), tFirst: null, tEnd: null, numChunks: 0, stopped: false };
  column.result = result;
  column.controller = new AbortController();
  delete column.el.dataset.outcome; // set again when this answer ends
  delete column.el.dataset.timeline;
  answer.textContent = "";
  $(".status-line", column.el).textContent = "sent";
  for (const name of ["ttft", "tps", "prompt", "cached"]) setFigure(column, name, "–");
  $(".timeline", column.el).replaceChildren();
  const timelinePoll = setInterval(() => drawTimelineOf(column), TIMELINE_POLL_MS);
  try {
    const response = await fetch(column.server.url(path), {
      method: "POST",
      headers: headers({ "Content-Type": "application/json", "X-Request-Timeline": "true" }),
      body: JSON.stringify(body),
      signal: column.controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error?.message || `HTTP ${response.status}`);
    }
    await readStream(column, response, answer);
  } catch (error) {
    if (error.name === "AbortError") result.stopped = true;
    else result.error = error.message;
  } finally {
    clearInterval(timelinePoll);
    result.tEnd = performance.now();
    column.controller = null;
  }
  showOutcome(column);
  if (!result.error && !result.stopped) column.messages.push({ role: "user", content: text }, { role: "assistant", content: result.text });
  await drawTimelineOf(column);
}

async function readStream(column, response, answer) {
  const result = column.result;
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const buffer = { text: "" };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer.text += decoder.decode(value, { stream: true });
    for (const data of sseEvents(buffer)) {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.id && !result.requestId) column.requestId = result.requestId = chunk.id;
      if (chunk.usage) result.usage = chunk.usage;
      const finish = (chunk.choices || [])[0]?.finish_reason;
      if (finish) result.finishReason = finish;
      const piece = chunkText(chunk);
      if (!piece) continue;
      const now = performance.now();
      if (result.tFirst === null) {
        result.tFirst = now;
        setFigure(column, "ttft", `${Math.round(now - result.t0)} ms`);
      }
      result.text += piece;
      result.numChunks += 1;
      answer.textContent = result.text;
      answer.scrollTop = answer.scrollHeight;
      if (result.numChunks > 1) setFigure(column, "tps", `${((1000 * (result.numChunks - 1)) / (now - result.tFirst)).toFixed(1)} ≈`);
    }
  }
}

function showOutcome(column) {
  const result = column.result;
  const usage = result.usage;
  if (usage) {
    setFigure(column, "prompt", usage.prompt_tokens);
    const cached = usage.prompt_tokens_details?.cached_tokens;
    if (cached !== undefined) setFigure(column, "cached", cached);
    if (usage.completion_tokens > 1 && result.tFirst !== null) {
      const seconds = (result.tEnd - result.tFirst) / 1000;
      setFigure(column, "tps", ((usage.completion_tokens - 1) / seconds).toFixed(1));
    }
  }
  const line = $(".status-line", column.el);
  const total = `${Math.round(result.tEnd - result.t0)} ms`;
  if (result.stopped) line.textContent = `stopped after ${total}`;
  else if (result.error) line.textContent = `error: ${result.error}`;
  else line.textContent = `finished (${result.finishReason || "?"}) in ${total}` + (usage ? `, ${usage.completion_tokens} tokens` : "");
  line.classList.toggle("error", Boolean(result.error));
  column.el.dataset.outcome = result.stopped ? "stopped" : result.error ? "error" : "finished";
}

async function drawTimelineOf(column) {
  const requestId = column.result?.requestId;
  if (!requestId) return;
  let response;
  try {
    response = await fetch(column.server.url(`/v1/requests/${encodeURIComponent(requestId)}/timeline`), { headers: headers() });
  } catch (error) {
    return;
  }
  const target = $(".timeline", column.el);
  if (!response.ok) {
    target.textContent = column.server.base ? "(this server gives no timeline)" : "";
    return;
  }
  const timeline = await response.json();
  drawTimeline(target, timeline, () => downloadTrace(column, requestId));
  const cached = timeline.requests.map((r) => (r.events.find((e) => e.type === "admitted") || {}).cached_tokens || 0);
  setFigure(column, "cached", cached.reduce((a, b) => a + b, 0));
  column.el.dataset.timeline = timeline.is_finished ? "finished" : "running";
}

async function downloadTrace(column, requestId) {
  const response = await fetch(column.server.url(`/v1/requests/${encodeURIComponent(requestId)}/timeline?format=chrome`), { headers: headers() });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(await response.blob());
  link.download = `${requestId}.trace.json`;
  link.click();
  URL.revokeObjectURL(link.href);
}

// ---- the controls ----

async function send() {
  const text = $("#prompt").value;
  const formError = $("#form-error");
  formError.hidden = true;
  try {
    samplingFields(); // a JSON schema that does not parse is said here, before anything is sent
  } catch (error) {
    formError.textContent = `The JSON schema does not parse: ${error.message}`;
    formError.hidden = false;
    return;
  }
  state.isRunning = true;
  $("#send").disabled = true;
  $("#stop-button").disabled = false;
  const columns = racingColumns();
  for (const column of state.columns) column.el.hidden = !columns.includes(column);
  for (const column of columns) {
    const last = column.result; // the previous answer moves up into the conversation
    if (last && !last.error && !last.stopped) addTurn(column, "assistant", last.text);
    addTurn(column, "user", text);
  }
  await Promise.all(columns.map((column) => runColumn(column, text)));
  state.isRunning = false;
  $("#send").disabled = false;
  $("#stop-button").disabled = true;
}

function addTurn(column, role, text) {
  if (state.mode !== "chat") return;
  const turn = document.createElement("div");
  turn.className = `turn ${role}`;
  turn.textContent = text;
  $(".conversation", column.el).append(turn);
}

function stop() {
  for (const column of state.columns) column.controller?.abort();
}

function clear() {
  for (const column of state.columns) {
    column.messages = [];
    $(".conversation", column.el).replaceChildren();
    $(".answer", column.el).textContent = "";
    $(".timeline", column.el).replaceChildren();
    $(".status-line", column.el).textContent = "";
    column.result = null;
  }
}

function setMode(mode) {
  state.mode = mode;
  for (const button of document.querySelectorAll(".mode")) button.classList.toggle("active", button.dataset.mode === mode);
  for (const el of document.querySelectorAll(".chat-only")) el.hidden = mode !== "chat";
  for (const el of document.querySelectorAll(".completion-only")) el.hidden = mode !== "completion";
  clear();
}

async function main() {
  state.config = await (await fetch("/playground/config.json")).json();
  $("#model-name").textContent = state.config.model;
  await fetchModels();
  await measurePrefix();
  const ours = addColumn(new Server("nanoserve", ""));
  ours.modelName = state.config.model;
  for (const name of state.config.peers) {
    const column = addColumn(new Server(name, `/v1/playground/peers/${encodeURIComponent(name)}`));
    const label = document.createElement("label");
    label.className = "switch";
    label.innerHTML = `<input type="checkbox" id="race-${name}" checked> race ${name}`;
    $("#peer-switches").append(label);
    fetch(column.server.url("/v1/models"), { headers: headers() })
      .then((r) => r.json())
      .then((models) => (column.modelName = models.data[0].id))
      .catch(() => {});
  }
  $("#send").addEventListener("click", send);
  $("#stop-button").addEventListener("click", stop);
  $("#clear").addEventListener("click", clear);
  for (const button of document.querySelectorAll(".mode")) button.addEventListener("click", () => setMode(button.dataset.mode));
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && !state.isRunning) send();
  });
  document.body.dataset.ready = "true";
}

main();
