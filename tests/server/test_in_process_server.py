"""The in-process test server (tests/servers.py) shuts down as `nanoserve serve` does on
SIGTERM: a stream in flight finishes within the grace period, then the server's threads end and
its port is free."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
from servers import InProcessServer


def test_stopping_finishes_streams_then_leaves_no_thread_and_a_free_port(
    tiny_model: Path, tmp_path: Path
) -> None:
    threads_before = set(threading.enumerate())
    server = InProcessServer(tiny_model, tmp_path / "server.log", "--shutdown-timeout", "60")
    try:
        server.wait_healthy()
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            stopping = threading.Thread(target=server.stop)
            stopping.start()
            deadline = time.monotonic() + 10
            while server.client.is_accepting:  # until the shutdown has begun
                assert time.monotonic() < deadline, "the server did not begin its shutdown"
                time.sleep(0.005)  # paces the poll
            assert server.client.num_in_flight == 1  # the stream was running then
            rest = [line for line in lines if line]
        stopping.join(60)
    finally:
        code = server.stop()  # a second stop returns at once
    assert rest[-1] == "data: [DONE]"  # finished within the grace period, not cut off
    assert '"finish_reason":"length"' in rest[-2]
    assert code == 0 and not server.client.is_running
    deadline = time.monotonic() + 10  # the tokenizer's thread ends once its last job has
    while not set(threading.enumerate()) <= threads_before and time.monotonic() < deadline:
        time.sleep(0.01)  # paces the poll
    assert set(threading.enumerate()) <= threads_before
    with socket.socket() as sock:  # nobody listens there any more: a new server may bind it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as serve binds (TIME_WAIT)
        sock.bind(("127.0.0.1", server.port))
        sock.listen()
