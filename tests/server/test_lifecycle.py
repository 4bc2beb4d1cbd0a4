"""Worker death, graceful shutdown and the API key, each on servers of their own."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import API_KEY, ServerProcess


@pytest.fixture
def own_server(tiny_model: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_model, tmp_path / "server.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def stream_lines(url: str, body: dict) -> Iterator[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        yield from (line for line in response.iter_lines() if line)


def test_worker_killed_mid_stream_then_restarted(own_server: ServerProcess) -> None:
    [worker] = own_server.worker_pids()
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
    lines = stream_lines(own_server.url, body)
    assert next(lines).startswith("data: {")
    os.kill(worker, signal.SIGKILL)
    rest = list(lines)  # the stream must end by itself
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "worker" in error["message"]
    assert httpx.get(f"{own_server.url}/health").status_code == 503
    refused = httpx.post(f"{own_server.url}/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 503 and "retry-after" in refused.headers
    own_server.wait_healthy(timeout_s=120)
    assert own_server.worker_pids() != [worker]
    response = httpx.post(
        f"{own_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_sigterm_finishes_in_flight_then_leaves_nothing(own_server: ServerProcess) -> None:
    [worker] = own_server.worker_pids()
    cmdline = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
    ipc_address = cmdline[cmdline.index(b"--to-worker") + 1].decode()
    ipc_dir = Path(ipc_address.removeprefix("ipc://")).parent
    assert ipc_dir.is_dir() and (ipc_dir.stat().st_mode & 0o777) == 0o700
    body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
    lines = stream_lines(own_server.url, body)
    assert next(lines).startswith("data: {")
    own_server.process.send_signal(signal.SIGTERM)
    rest = list(lines)  # the grace period lets it finish
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert own_server.process.wait(timeout=30) == 0
    assert own_server.worker_pids() == []
    deadline = time.monotonic() + 5
    while Path(f"/proc/{worker}").exists():  # reaped by the server, so gone
        assert time.monotonic() < deadline, "the worker outlived the server"
        time.sleep(0.05)
    assert not ipc_dir.exists()


def test_api_key(cycle_server: ServerProcess) -> None:
    url = cycle_server.url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
    body = {"prompt": "H", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=body, headers=good).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_health_is_503_while_the_model_loads(tiny_model: Path, tmp_path: Path) -> None:
    """The front answers as soon as it listens; the worker loads the model behind it."""
    server = ServerProcess(tiny_model, tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 120
        while True:  # until the front answers at all
            assert time.monotonic() < deadline and server.process.poll() is None, server.log()
            try:
                health = httpx.get(f"{server.url}/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert health.status_code == 503, "the front answered only once the model was loaded"
        assert "not ready" in health.json()["error"]["message"]
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        server.wait_healthy()
        done = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert done.status_code == 200
    finally:
        assert server.stop() == 0
