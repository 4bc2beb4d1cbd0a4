"""Worker death, a hung worker and graceful shutdown, on real server processes: the two worker
deaths on the shared `front_process`, which replaces its workers, each shutdown on a server of
its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import ServerProcess, child_pids
from tiny_checkpoints import make_tiny_checkpoint


@contextlib.contextmanager
def serving(model: Path, tmp_path: Path, *flags: str) -> Iterator[ServerProcess]:
    server = ServerProcess(model, tmp_path / "server.log", *flags)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_server(tiny_model: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    with serving(tiny_model, tmp_path) as server:
        yield server


@pytest.fixture(scope="module")
def slower_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider, deeper random model: its 900-token streams outlast a 3 s shutdown grace on any
    core count (the tiny model's could finish within it once the worker had both cores)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("slower"), "qwen3", hidden_size=512, intermediate_size=1536,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=1024,
    )  # fmt: skip


@pytest.fixture
def slower_server(slower_model: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    with serving(slower_model, tmp_path) as server:
        yield server


def error_frame(line: str) -> dict:
    assert line.startswith("data: {"), line
    return json.loads(line[len("data: ") :])["error"]


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Poll `predicate` until true; the seconds it took."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not {what} after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


def stream_lines(url: str, body: dict) -> Iterator[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        yield from (line for line in response.iter_lines() if line)


def test_worker_killed_mid_stream_then_restarted(front_process: ServerProcess) -> None:
    server = front_process  # it replaces the workers these tests kill
    [worker] = server.worker_pids()
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
    lines = stream_lines(server.url, body)
    assert next(lines).startswith("data: {")
    os.kill(worker, signal.SIGKILL)
    rest = list(lines)  # the stream must end by itself
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "worker" in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 503
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 503 and "retry-after" in refused.headers
    server.wait_healthy(timeout_s=120)
    assert server.worker_pids() != [worker]
    response = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1


def ipc_socket_path(worker_pid: int) -> Path:
    """The front's socket file a worker connects to, from its command line."""
    argv = Path(f"/proc/{worker_pid}/cmdline").read_bytes().decode().split("\0")
    return Path(argv[argv.index("--to-worker") + 1].removeprefix("ipc://"))


@pytest.mark.slow  # two worker restarts
def test_each_replaced_worker_takes_its_socket_files_with_it(front_process: ServerProcess) -> None:
    server = front_process  # it replaces the workers this test kills
    for _ in range(2):
        [worker] = server.worker_pids()
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda w=worker: server.worker_pids() not in ([], [w]), 60, "a new worker")
        server.wait_healthy(timeout_s=120)
    [worker] = server.worker_pids()
    to_worker = ipc_socket_path(worker)
    generation = to_worker.name.removeprefix("to_worker_")
    assert sorted(p.name for p in to_worker.parent.iterdir()) == [
        f"to_front_{generation}",
        f"to_worker_{generation}",
    ]


def test_sigterm_finishes_in_flight_then_leaves_nothing(own_server: ServerProcess) -> None:
    [worker] = own_server.worker_pids()
    ipc_dir = ipc_socket_path(worker).parent
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


@pytest.mark.slow  # two worker restarts
def test_a_stopped_worker_is_detected_killed_and_replaced(
    front_process: ServerProcess,
) -> None:
    server = front_process  # it replaces the workers these tests kill
    [worker] = server.worker_pids()
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
    lines = stream_lines(server.url, body)
    assert next(lines).startswith("data: {")
    os.kill(worker, signal.SIGSTOP)  # hung: alive, silent
    started = time.monotonic()
    rest = list(lines)  # the stream ends by itself: an error frame, then [DONE]
    assert time.monotonic() - started < 20
    assert rest[-1] == "data: [DONE]"
    error = error_frame(rest[-2])
    assert error["code"] == 503 and "no heartbeat" in error["message"], error
    wait_for(lambda: not Path(f"/proc/{worker}").exists(), 10, "the hung worker killed")
    server.wait_healthy(timeout_s=120)
    [replacement] = server.worker_pids()
    assert replacement != worker
    answer = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30
    )
    assert answer.status_code == 200

    os.kill(replacement, signal.SIGSTOP)  # an idle worker that hangs is noticed too
    wait_for(lambda: health(server.url) == 503, 20, "/health 503 for an idle hung worker")
    server.wait_healthy(timeout_s=120)
    assert server.worker_pids() not in ([replacement], [])


async def stream_until_end(
    client: httpx.AsyncClient, url: str, body: dict, first_frame: asyncio.Event
) -> list[str]:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = []
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
                first_frame.set()
        return lines


async def sigterm_under_load(server: ServerProcess) -> tuple[list[list[str]], list, float]:
    """Eight long streams and two long plain requests; SIGTERM once every stream has begun."""
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        firsts = [asyncio.Event() for _ in range(8)]
        streams = [
            asyncio.create_task(
                stream_until_end(client, server.url, {**body, "n": 1 + i % 3, "stream": True}, f)
            )
            for i, f in enumerate(firsts)
        ]
        plain = [
            asyncio.create_task(client.post(f"{server.url}/v1/completions", json=body))
            for _ in range(2)
        ]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
        server.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        ended = await asyncio.gather(*streams)
        elapsed = time.monotonic() - started
        answers = await asyncio.gather(*plain, return_exceptions=True)
    return ended, answers, elapsed


def test_sigterm_under_load_ends_every_stream_with_done(slower_server: ServerProcess) -> None:
    [worker] = slower_server.worker_pids()
    ended, answers, elapsed = asyncio.run(sigterm_under_load(slower_server))
    assert elapsed < 3 + 2 + 3  # --shutdown-timeout 3, the flush, slack
    for lines in ended:
        assert lines[-1] == "data: [DONE]"
        error = error_frame(lines[-2])
        assert error["code"] == 503 and error["message"] == "the server is shutting down"
    for answer in answers:
        assert isinstance(answer, httpx.Response) and answer.status_code == 503, answer
    assert slower_server.process.wait(timeout=30) == 0
    wait_for(lambda: not Path(f"/proc/{worker}").exists(), 10, "the worker gone")
    log = slower_server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_health_is_503_while_the_model_loads(tiny_model: Path, tmp_path: Path) -> None:
    """The front answers as soon as it listens; the worker loads the model behind it. The worker
    starts before the front loads its tokenizer, and the tiny model loads in less time than
    that: it is stopped (SIGSTOP) as soon as it exists, a worker still loading, until the front
    has answered."""
    server = ServerProcess(tiny_model, tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 120
        while not (workers := child_pids(server.process.pid)):
            assert time.monotonic() < deadline and server.process.poll() is None, server.log()
            time.sleep(0.01)  # paces the poll
        [worker] = workers
        os.kill(worker, signal.SIGSTOP)
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
        os.kill(worker, signal.SIGCONT)
        server.wait_healthy()
        done = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert done.status_code == 200
    finally:
        assert server.stop() == 0
