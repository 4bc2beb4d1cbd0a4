// A request's timeline (GET /v1/requests/{id}/timeline) drawn as one lane per engine request:
// waiting in grey, prompt chunks in blue (the prefix-cache hit marked where it was admitted),
// decode runs in green (each step's batch size in its tooltip and in the table), recomputes
// after a preemption in orange, a preemption as a red mark, the end as a black one.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const LANE_HEIGHT = 26;
const COLORS = { waiting: "#c3c9d4", prefill: "#2f6fde", decode: "#1f9d55", recompute: "#e07b00", preempted: "#d64545", finished: "#1d2330", cached: "#0e9aa7" };

function svgElement(name, attributes, title) {
  const el = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) el.setAttribute(key, value);
  if (title) {
    const t = document.createElementNS(SVG, "title");
    t.textContent = title;
    el.append(t);
  }
  return el;
}

function eventEnd(event) {
  return event.end ?? event.t ?? 0;
}

function ms(seconds) {
  return `${(seconds * 1000).toFixed(1)} ms`;
}

function describe(event) {
  // One line a learner can read, per event.
  switch (event.type) {
    case "arrived": return "the HTTP request arrived";
    case "queued": return "tokenized and sent to the engine: it waits in the queue";
    case "admitted": return event.cached_tokens ? `admitted: ${event.cached_tokens} prompt tokens found in the prefix cache, not computed` : "admitted: nothing in the prefix cache";
    case "prefill": return `prefill: prompt tokens ${event.first_position}–${event.first_position + event.num_tokens - 1} (${event.num_tokens}) in step ${event.first_step}, batch of ${event.batch_size} request(s), ${event.batch_tokens} tokens`;
    case "recompute": return `recompute after preemption: tokens ${event.first_position}–${event.first_position + event.num_tokens - 1} in step ${event.first_step}, batch of ${event.batch_size}`;
    case "decode": return `decode: ${event.num_tokens} token(s) in ${event.num_steps} step(s) (${event.first_step}–${event.last_step}), batch of ${event.batch_size} request(s) each step`;
    case "preempted": return "preempted: its KV blocks went to an older request; it waits to run again";
    case "finished": return `finished: ${event.reason}`;
    default: return event.type;
  }
}

function drawLane(svg, request, y, scale) {
  let waitStart = null;
  for (const event of request.events) {
    const group = svgElement("g", { class: "tl-event", "data-type": event.type });
    if (event.type === "queued" || event.type === "preempted") waitStart = event.t;
    if (event.type === "admitted") {
      if (waitStart !== null) group.append(svgElement("rect", { x: scale(waitStart), y: y + 8, width: Math.max(1, scale(event.t) - scale(waitStart)), height: 8, fill: COLORS.waiting }, `waiting ${ms(event.t - waitStart)}`));
      waitStart = null;
      group.dataset.cached = event.cached_tokens;
      if (event.cached_tokens) group.append(svgElement("rect", { x: scale(event.t) - 3, y: y + 1, width: 6, height: 22, fill: COLORS.cached }, describe(event)));
    } else if (event.start !== undefined) {
      const width = Math.max(2, scale(event.end) - scale(event.start));
      group.append(svgElement("rect", { x: scale(event.start), y: y + 3, width, height: 18, fill: COLORS[event.type], opacity: event.type === "decode" ? 0.45 + 0.55 / event.batch_size : 1 }, describe(event)));
    } else if (event.type === "preempted" || event.type === "finished") {
      group.append(svgElement("rect", { x: scale(event.t) - 1.5, y: y, width: 3, height: 24, fill: COLORS[event.type] }, describe(event)));
    }
    svg.append(group);
  }
}

function eventTable(requests) {
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  summary.textContent = "what the engine did, step by step";
  details.append(summary);
  const table = document.createElement("table");
  for (const request of requests) {
    for (const event of request.events) {
      const row = table.insertRow();
      const t = row.insertCell();
      t.className = "t";
      t.textContent = ms(event.t ?? event.start);
      row.insertCell().textContent = (requests.length > 1 ? `[${request.request_id.split("-").pop()}] ` : "") + describe(event);
    }
  }
  details.append(table);
  return details;
}

function drawTimeline(target, timeline, onDownload) {
  const WIDTH = Math.max(200, target.clientWidth || 1000); // drawn at the column's own width
  const requests = timeline.requests;
  const end = Math.max(1e-3, ...requests.flatMap((r) => r.events.map(eventEnd)));
  const scale = (t) => 4 + (t / end) * (WIDTH - 8);
  const height = requests.length * LANE_HEIGHT + 16;
  const svg = svgElement("svg", { viewBox: `0 0 ${WIDTH} ${height}`, width: WIDTH, height, role: "img", "aria-label": "request timeline" });
  requests.forEach((request, index) => drawLane(svg, request, index * LANE_HEIGHT, scale));
  const axis = svgElement("text", { x: WIDTH - 4, y: height - 3, "text-anchor": "end", "font-size": 11, fill: "#667085" });
  axis.textContent = `${ms(end)} since arrival`;
  svg.append(axis);
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const [name, color] of Object.entries(COLORS)) legend.insertAdjacentHTML("beforeend", `<span><i style="background:${color}"></i>${name}</span>`);
  const links = document.createElement("div");
  links.className = "links";
  const button = document.createElement("button");
  button.textContent = "Chrome trace (chrome://tracing, Perfetto)";
  button.addEventListener("click", onDownload);
  links.append(button);
  const open = target.querySelector("details")?.open ?? false;
  const table = eventTable(requests);
  table.open = open;
  target.replaceChildren(svg, legend, table, links);
}
