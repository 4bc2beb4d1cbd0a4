"""The playground in a real browser: Debian's chromium driven by Playwright (never a browser of
Playwright's own) against real servers on 127.0.0.1.

The page loads with nothing from elsewhere; a chat streams into the page chunk by chunk; stop
aborts (the server's running count returns to 0); the status light follows a worker restart
(ready → loading → ready) and the server's end (down); a race against a second nanoserve shows
both columns; a request behind the long shared prefix shows the prefix-cache hit in its
timeline; the API key is asked for, refused, then taken.

The README's screenshots are made here: set NANOSERVE_SCREENSHOTS=docs/images to write them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright
from servers import API_KEY, InProcessServer, ServerProcess, read_metrics
from tiny_checkpoints import make_tiny_checkpoint

VIEWPORT = {"width": 1000, "height": 600}
TIMEOUT_MS = 60_000
DEMO = "nanoserve-demo"
FIBONACCI = "def fibonacci(n):"
# Records each change of the first column's answer: [ms since the observer started, length].
OBSERVE_ANSWER = """() => {
  window.seen = [];
  const answer = document.querySelector('.column .answer');
  const t0 = performance.now();
  new MutationObserver(() => window.seen.push([performance.now() - t0, answer.textContent.length]))
    .observe(answer, {childList: true, characterData: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path is not None, "the browser tests need Debian's `chromium` (.ci/run installs it)"
    return path


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[object]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert errors == [], errors  # no script error on the page


def open_page(page, url: str) -> None:
    page.goto(f"{url}/?poll_ms=200")
    page.wait_for_selector("body[data-ready=true]")


def shoot(page, tmp_path: Path, name: str) -> Path:
    """A screenshot once every light has caught up, kept small; also copied where
    NANOSERVE_SCREENSHOTS says."""
    page.wait_for_function(
        "[...document.querySelectorAll('.column:not([hidden]) .light')]"
        ".every(light => light.dataset.state === 'ready')"
    )
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size < 120_000
    if target := os.environ.get("NANOSERVE_SCREENSHOTS"):  # 96 colours: tens of KB
        from PIL import Image

        Path(target).mkdir(parents=True, exist_ok=True)
        with Image.open(path) as image:
            small = image.convert("RGB").quantize(96, dither=Image.Dither.NONE)
            small.save(Path(target) / path.name, optimize=True)
    return path


def fill_settings(page, max_tokens: int, temperature: float = 0.0) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))


def wait_outcome(page, server_name: str = "nanoserve") -> str:
    column = page.locator(f'.column[data-server="{server_name}"]')
    page.wait_for_function(
        f"document.querySelector('.column[data-server=\"{server_name}\"]').dataset.timeline "
        "=== 'finished' || ['stopped', 'error'].includes(document.querySelector("
        f"'.column[data-server=\"{server_name}\"]').dataset.outcome)"
    )
    return column.get_attribute("data-outcome") or ""


# ---- servers ----


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model a few times wider and deeper than the tiny one: a long answer takes
    seconds, time enough to watch it stream and to stop it."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("slow"),
        "qwen3",
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        max_position_embeddings=2048,
    )


@pytest.fixture(scope="module")
def slow_server(slow_model: Path, tmp_path_factory: pytest.TempPathFactory):
    # float32 (as the other test servers) and no prefix cache: every request computes its prompt.
    with InProcessServer(
        slow_model,
        tmp_path_factory.mktemp("log") / "server.log",
        "--served-model-name",
        "slow",
        "--dtype",
        "float32",
        "--no-enable-prefix-caching",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory):
    with InProcessServer(
        DEMO, tmp_path_factory.mktemp("log") / "server.log", "--dtype", "float32"
    ) as server:
        yield server


# ---- the page's routes ----


def test_the_page_and_its_files_are_served_from_the_package(server: InProcessServer) -> None:
    index = httpx.get(f"{server.url}/", timeout=30)
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert '<script src="/playground/app.js"' in index.text
    for name, kind in [
        ("app.js", "text/javascript"),
        ("timeline.js", "text/javascript"),
        ("style.css", "text/css"),
    ]:
        response = httpx.get(f"{server.url}/playground/{name}", timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    for name in ("page.py", "..%2Fapp.py", "nope.js"):  # a request names no file
        response = httpx.get(f"{server.url}/playground/{name}", timeout=30)
        assert response.status_code == 404 and response.json()["error"]["code"] == 404
    config = httpx.get(f"{server.url}/playground/config.json", timeout=30).json()
    assert config == {"model": "tiny", "api_key_required": False, "peers": []}


def test_disable_playground_turns_the_page_off(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with InProcessServer(
        tiny_model, tmp_path_factory.mktemp("log") / "server.log", "--disable-playground"
    ) as server:
        for path in ("/", "/playground/app.js", "/v1/playground/peers"):
            assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 404


# ---- the page in the browser ----


def test_the_page_loads_with_nothing_from_elsewhere(page, demo_server: InProcessServer) -> None:
    requested: list[str] = []

    def only_this_server(route) -> None:
        requested.append(route.request.url)
        if route.request.url.startswith(demo_server.url):
            route.continue_()
        else:
            route.abort()  # offline: anything from elsewhere fails

    page.route("**/*", only_this_server)
    open_page(page, demo_server.url)
    page.wait_for_selector('.column[data-server="nanoserve"] .light[data-state="ready"]')
    assert page.inner_text("#model-name") == DEMO
    assert requested and all(url.startswith(demo_server.url) for url in requested), requested
    paths = {url.removeprefix(demo_server.url).split("?")[0] for url in requested}
    assert {"/", "/playground/app.js", "/playground/style.css", "/health", "/metrics"} <= paths


def streamed_content(sse_body: str) -> str:
    """The text of a chat completion's SSE stream: its deltas' content, joined."""
    pieces = []
    for line in sse_body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces)


def test_a_chat_streams_into_the_page_chunk_by_chunk(page, slow_server: InProcessServer) -> None:
    open_page(page, slow_server.url)
    fill_settings(page, max_tokens=300)
    page.fill("#prompt", "Tell me a story")
    page.evaluate(OBSERVE_ANSWER)
    with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as response:
        page.click("#send")
    assert wait_outcome(page) == "finished"
    text = page.inner_text(".column .answer")
    seen = page.evaluate("window.seen")
    lengths = [length for _, length in seen]
    final = len(page.evaluate("document.querySelector('.column .answer').textContent"))
    assert lengths[-1] == final > 0
    partial = [t for t, length in seen if 0 < length < final]
    assert len(partial) >= 10, seen  # the text grew in many steps, not all at the end
    assert partial[-1] - partial[0] > 0  # and over time
    # The page shows exactly what the server streamed. (Not compared with the same request sent
    # again: a random model's greedy near-tie flipped one token between two runs, once.)
    sse_body = response.value.text()
    assert streamed_content(sse_body).strip() == text.strip()
    usage = json.loads(sse_body.split("data: ")[-2])["usage"]  # the chunk before [DONE]
    assert usage["completion_tokens"] > 10
    assert page.inner_text(".column .fig-ttft").endswith(" ms")
    assert float(page.inner_text(".column .fig-tps")) > 0
    assert page.inner_text(".column .fig-prompt") == str(usage["prompt_tokens"])


def test_the_settings_make_the_request(page, demo_server: InProcessServer) -> None:
    open_page(page, demo_server.url)
    page.fill("#system-prompt", "Be brief.")
    page.check("#thinking")
    for field, value in [
        ("temperature", "0.7"),
        ("top_p", "0.9"),
        ("top_k", "40"),
        ("min_p", "0.05"),
        ("max_tokens", "8"),
        ("seed", "7"),
    ]:
        page.fill(f"#{field}", value)
    page.fill("#stop", "\\n\n\nEND")  # a written-out newline, an empty line, END
    page.fill("#json-schema", "{oops")
    page.fill("#prompt", "import os")
    page.click("#send")
    assert page.inner_text("#form-error").startswith("The JSON schema does not parse")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    page.fill("#json-schema", json.dumps(schema))
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    body = sent.value.post_data_json
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "import os"},
    ]
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 40)
    assert (body["min_p"], body["max_tokens"], body["seed"]) == (0.05, 8, 7)
    assert body["stop"] == ["\n", "END"] and body["stream"] is True
    assert body["response_format"]["json_schema"]["schema"] == schema
    assert sent.value.headers["x-request-timeline"] == "true"
    assert wait_outcome(page) == "finished"
    page.click("#mode-completion")
    page.fill("#fim-suffix", "    return x")
    page.fill("#json-schema", "")
    with page.expect_request("**/v1/completions") as sent:
        page.click("#send")
    body = sent.value.post_data_json
    assert (body["prompt"], body["suffix"]) == ("import os", "    return x")
    assert "messages" not in body and "response_format" not in body
    wait_outcome(page)


def test_stop_aborts_the_request_in_the_server(page, slow_server: InProcessServer) -> None:
    open_page(page, slow_server.url)
    fill_settings(page, max_tokens=1800, temperature=1.0)
    page.fill("#prompt", "Go on and on")
    before = read_metrics(slow_server.url)
    page.click("#send")
    page.wait_for_function("document.querySelector('.column .answer').textContent.length > 0")
    page.click("#stop-button")
    assert wait_outcome(page) == "stopped"
    assert page.inner_text(".column .status-line").startswith("stopped after")
    deadline = time.monotonic() + 10
    while read_metrics(slow_server.url)["vllm:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the server still runs the stopped request"
        time.sleep(0.05)
    after = read_metrics(slow_server.url)
    aborted = "vllm:request_success_total{finished_reason=abort}"
    assert after[aborted] - before[aborted] == 1
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 1800  # it did not run to the end
    page.wait_for_selector('.column .light[data-state="ready"]')


def test_a_race_against_a_second_nanoserve_shows_both_columns(
    page, demo_server: InProcessServer, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    peer = ("--playground-peer", f"peer={demo_server.url}/v1", "--dtype", "float32")
    with InProcessServer(DEMO, tmp_path_factory.mktemp("log") / "server.log", *peer) as server:
        open_page(page, server.url)
        page.click("#mode-completion")
        fill_settings(page, max_tokens=48)
        page.fill("#prompt", FIBONACCI)
        for name in ("nanoserve", "peer"):
            page.wait_for_selector(f'.column[data-server="{name}"] .light[data-state="ready"]')
        page.click("#send")
        assert wait_outcome(page, "nanoserve") == "finished"
        assert wait_outcome(page, "peer") == "finished"  # a nanoserve peer has timelines too
        body = {"model": DEMO, "prompt": FIBONACCI, "max_tokens": 48, "temperature": 0}
        expected = httpx.post(f"{demo_server.url}/v1/completions", json=body, timeout=60)
        text = expected.json()["choices"][0]["text"]
        for name in ("nanoserve", "peer"):
            column = f'.column[data-server="{name}"]'
            assert page.evaluate(f"document.querySelector('{column} .answer').textContent") == text
            assert page.inner_text(f"{column} .fig-ttft").endswith(" ms")
            assert page.locator(f'{column} .tl-event[data-type="decode"]').count() >= 1
        shoot(page, tmp_path, "playground-race")


def test_the_timeline_of_a_request_behind_a_cached_prefix_shows_the_hit(
    page, demo_server: InProcessServer, tmp_path: Path
) -> None:
    open_page(page, demo_server.url)
    page.click("#mode-completion")
    page.check("#long-prefix")
    fill_settings(page, max_tokens=24)
    page.fill("#prompt", FIBONACCI)
    admitted = '.column .tl-event[data-type="admitted"]'
    page.click("#send")
    assert wait_outcome(page) == "finished"
    first_hit = int(page.get_attribute(admitted, "data-cached") or 0)
    page.click("#send")  # the same prefix again: now in the cache
    assert wait_outcome(page) == "finished"
    hit = int(page.get_attribute(admitted, "data-cached") or 0)
    assert hit > max(first_hit, 100)  # hundreds of the prefix's tokens not computed again
    assert page.inner_text(".column .fig-cached") == str(hit)
    page.click(".timeline summary")
    table = page.inner_text(".timeline table")
    assert f"admitted: {hit} prompt tokens found in the prefix cache" in table
    assert "decode:" in table and "finished: length" in table
    shoot(page, tmp_path, "playground-timeline")


def test_the_api_key_is_asked_for_refused_then_taken(page, cycle_server: InProcessServer) -> None:
    page.goto(f"{cycle_server.url}/?poll_ms=200")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#api-key", "wrong")
    page.click("#key-ok")
    page.wait_for_function("document.querySelector('#key-message').textContent.includes('refused')")
    page.fill("#api-key", API_KEY)
    page.click("#key-ok")
    page.wait_for_selector("body[data-ready=true]")
    assert page.inner_text("#model-name") == "cycle"
    page.click("#mode-completion")
    fill_settings(page, max_tokens=6)
    page.fill("#prompt", "H")
    page.click("#send")
    assert wait_outcome(page) == "finished"
    assert page.evaluate("document.querySelector('.column .answer').textContent") != ""
    assert page.evaluate("sessionStorage.getItem('nanoserve-playground-key')") == API_KEY


def test_the_light_follows_a_worker_restart(page, front_process: ServerProcess) -> None:
    server = front_process  # shared: it replaces the workers tests kill
    server.wait_healthy()
    open_page(page, server.url)
    light = '.column[data-server="nanoserve"] .light'
    page.wait_for_selector(f'{light}[data-state="ready"]')
    (worker,) = server.worker_pids()
    os.kill(worker, signal.SIGKILL)
    page.wait_for_selector(f'{light}[data-state="loading"]')  # /health: 503 while it restarts
    page.wait_for_selector(f'{light}[data-state="ready"]', timeout=180_000)
    assert server.worker_pids() != [worker]
    history = page.evaluate("window.playground.columns[0].lightHistory")
    assert history[-3:] == ["ready", "loading", "ready"], history


def test_the_light_goes_down_when_the_server_stops(
    page, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with InProcessServer(tiny_model, tmp_path_factory.mktemp("log") / "server.log") as server:
        open_page(page, server.url)
        light = '.column[data-server="nanoserve"] .light'
        page.wait_for_selector(f'{light}[data-state="ready"]')
    page.wait_for_selector(f'{light}[data-state="down"]')
    assert page.inner_text(".column .light-label") == "down (no answer)"
