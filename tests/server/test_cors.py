"""CORS as vLLM configures it: every origin, method and header by default, preflights answered
on every route without the API key, and the headers on every answer (errors and streams too);
`--allowed-origins` and `--allow-credentials` narrow it. The last test is a real browser: a
page served from one port calls the API on another."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from servers import API_KEY, InProcessServer

from nanoserve.cli.main import build_parser

ORIGIN = "http://127.0.0.1:9"  # a page's origin: another port than the API's
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health",
         "/metrics", "/tokenize", "/ping", "/load"]  # fmt: skip
BROWSER_TIMEOUT_S = 90


def preflight(url: str, path: str, origin: str = ORIGIN) -> httpx.Response:
    """What a browser sends before a cross-origin POST with a key and a JSON body."""
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    return httpx.options(f"{url}{path}", headers=headers, timeout=30)


@pytest.mark.parametrize("path", PATHS)
def test_a_preflight_is_answered_on_every_route(server: InProcessServer, path: str) -> None:
    response = preflight(server.url, path)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "*"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "authorization,content-type"
    assert "access-control-allow-credentials" not in response.headers


def test_a_preflight_needs_no_api_key(cycle_server: InProcessServer) -> None:
    response = preflight(cycle_server.url, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "*"


def test_errors_carry_the_cors_headers(
    server: InProcessServer, cycle_server: InProcessServer
) -> None:
    headers = {"Origin": ORIGIN}
    unauthorized = httpx.get(f"{cycle_server.url}/v1/models", headers=headers, timeout=30)
    bad = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "n": 0}, headers=headers, timeout=30
    )
    unknown = httpx.get(f"{server.url}/v1/models/nope", headers=headers, timeout=30)
    assert [r.status_code for r in (unauthorized, bad, unknown)] == [401, 400, 404]
    for response in (unauthorized, bad, unknown):
        assert response.headers["access-control-allow-origin"] == "*"
        assert "error" in response.json()


def test_a_stream_carries_the_cors_headers(server: InProcessServer) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers={"Origin": ORIGIN}, timeout=60
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["access-control-allow-origin"] == "*"
        assert list(response.iter_lines())[-2:] == ["data: [DONE]", ""]


@pytest.fixture(scope="module")
def narrow_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    flags = ("--allowed-origins", '["http://app.test"]', "--allow-credentials")
    log = tmp_path_factory.mktemp("log") / "server.log"
    with InProcessServer(tiny_model, log, *flags) as server:
        yield server


def test_allowed_origins_and_credentials(narrow_server: InProcessServer) -> None:
    allowed = preflight(narrow_server.url, "/v1/completions", "http://app.test")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://app.test"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    refused = preflight(narrow_server.url, "/v1/completions", "http://other.test")
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": "CORS preflight refused: its origin is not allowed here (the server's "
        "--allowed-origins, --allowed-methods and --allowed-headers say what is)",
        "type": "invalid_request_error",
        "param": None,
        "code": 400,
    }
    assert "access-control-allow-origin" not in refused.headers
    plain = httpx.get(f"{narrow_server.url}/health", headers={"Origin": "http://other.test"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


@pytest.fixture(scope="module")
def methods_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    flags = ("--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["content-type"]')
    log = tmp_path_factory.mktemp("log") / "server.log"
    with InProcessServer(tiny_model, log, *flags) as server:
        yield server


def test_allowed_methods_and_headers(methods_server: InProcessServer) -> None:
    url = f"{methods_server.url}/v1/completions"
    asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    allowed = httpx.options(
        url, headers={**asked, "Access-Control-Request-Headers": "content-type"}
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-methods"] == "GET, POST"
    assert allowed.headers["access-control-allow-origin"] == "*"
    no_method = httpx.options(url, headers={**asked, "Access-Control-Request-Method": "DELETE"})
    assert no_method.status_code == 400 and "its method is not allowed" in no_method.text
    no_header = httpx.options(url, headers={**asked, "Access-Control-Request-Headers": "x-key"})
    assert no_header.status_code == 400 and "its headers are not allowed" in no_header.text
    simple = httpx.get(f"{methods_server.url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("value", ["*", '{"a": 1}', '["a", 2]', "[oops"])
def test_a_cors_flag_takes_a_json_list_of_strings(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--allowed-origins", value])
    assert exit_info.value.code == 2
    assert "not a JSON list of strings" in capsys.readouterr().err


def test_cors_flags_default_to_vllms() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == (["*"],) * 3
    assert args.allow_credentials is False


# ---- a real browser ----

PAGE = """<!doctype html><meta charset="utf-8"><title>cors</title><script>
const api = "API", key = "KEY";
async function run() {
  const out = {origin: location.origin};
  try {
    const models = await fetch(api + "/v1/models", {headers: {Authorization: "Bearer " + key}});
    out.models = (await models.json()).data.map(m => m.id);
    const stream = await fetch(api + "/v1/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", Authorization: "Bearer " + key},
      body: JSON.stringify({prompt: "C", max_tokens: 3, stream: true}),
    });
    out.stream = await stream.text();
    const refused = await fetch(api + "/v1/models");  // no key: a 401 the page can read
    out.refused = [refused.status, (await refused.json()).error.code];
  } catch (e) {
    out.error = String(e);
  }
  await fetch("/report", {method: "POST", body: JSON.stringify(out)});
}
run();
</script>"""


class PageServer(ThreadingHTTPServer):
    """Serves the page on its own port and takes the page's report."""

    def __init__(self, page: str) -> None:
        self.page = page.encode()
        self.report: dict | None = None
        self.reported = threading.Event()
        super().__init__(("127.0.0.1", 0), PageHandler)


class PageHandler(BaseHTTPRequestHandler):
    server: PageServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.server.page)))
        self.end_headers()
        self.wfile.write(self.server.page)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        self.server.report = json.loads(self.rfile.read(length))
        self.send_response(204)
        self.end_headers()
        self.server.reported.set()

    def log_message(self, *args: object) -> None:
        pass  # quiet


@pytest.fixture
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path is not None, "the browser test needs Debian's `chromium` (.ci/run installs it)"
    return path


@pytest.fixture
def page_server(cycle_server: InProcessServer) -> Iterator[PageServer]:
    page = PAGE.replace("API", cycle_server.url).replace("KEY", API_KEY)
    server = PageServer(page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def run_headless(chromium: str, url: str, profile: Path, until: threading.Event) -> None:
    """Chromium on `url` until `until` is set (or the timeout); it and its children end."""
    command = [
        chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--no-default-browser-check", f"--user-data-dir={profile}", url,
    ]  # fmt: skip
    browser = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        until.wait(BROWSER_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # its own session: its renderers too
            os.killpg(browser.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            browser.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # whatever of it is left
            os.killpg(browser.pid, signal.SIGKILL)
        browser.wait()


def test_a_page_on_another_origin_calls_the_api(
    chromium: str, page_server: PageServer, cycle_server: InProcessServer, tmp_path: Path
) -> None:
    page_url = f"http://127.0.0.1:{page_server.server_address[1]}/"
    run_headless(chromium, page_url, tmp_path / "profile", page_server.reported)
    report = page_server.report
    assert report is not None, "the page never reported (chromium did not run it)"
    assert "error" not in report, report
    assert report["origin"] != cycle_server.url  # another origin: CORS applied
    assert report["models"] == ["cycle"]
    frames = [line for line in report["stream"].split("\n") if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]" and len(frames) >= 2
    assert report["refused"] == [401, 401]
