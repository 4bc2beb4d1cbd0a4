"""The deadlines uvicorn lacks: a connection that never completes its headers is closed; a
client that reads nothing while its send buffer is full is disconnected and its requests
aborted, while one that reads, however slowly, is served to the end. (Server: one-second
timeouts.)"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import uvicorn
from servers import InProcessServer, read_metrics
from uvicorn.server import ServerState

from nanoserve.server.http_server import timed_h11_protocol

DISCONNECTED = "vllm:http_requests_client_disconnected_total"
GENERATED = "vllm:generation_tokens_total"
# Big frames (20 logprobs per token), more than the kernel's socket buffers (4 MiB) hold, and
# 32 choices: the buffers fill within tens of steps, long before the 900th.
NUM_CHOICES, MAX_TOKENS = 32, 900
HEAVY = {"prompt": "x", "n": NUM_CHOICES, "logprobs": 20, "max_tokens": MAX_TOKENS,
         "ignore_eos": True, "stream": True}  # fmt: skip


def connect(port: int, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    return sock


def seconds_until_closed(sock: socket.socket) -> float:
    started = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - started


def test_a_connection_without_headers_is_closed(strict_server: InProcessServer) -> None:
    silent = connect(strict_server.port)
    partial = connect(strict_server.port)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
    assert seconds_until_closed(silent) < 10
    assert seconds_until_closed(partial) < 10


def test_keep_alive_then_a_partial_request_is_closed(strict_server: InProcessServer) -> None:
    sock = connect(strict_server.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    time.sleep(0.5)  # the client is idle (half the header timeout): the connection stays
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # a third request that never ends
    assert seconds_until_closed(sock) < 10


def test_an_unread_body_after_the_answer_is_closed(strict_server: InProcessServer) -> None:
    sock = connect(strict_server.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    assert seconds_until_closed(sock) < 10


def send_request(port: int, body: dict, receive_buffer: int) -> socket.socket:
    data = json.dumps(body).encode()
    sock = connect(port, receive_buffer)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_a_client_that_reads_nothing_is_disconnected(strict_server: InProcessServer) -> None:
    url = strict_server.url
    before = read_metrics(url)
    sock = send_request(strict_server.port, HEAVY, receive_buffer=4096)  # and never read
    deadline = time.monotonic() + 60
    while (metrics := read_metrics(url))[DISCONNECTED] < before[DISCONNECTED] + 1:
        assert time.monotonic() < deadline, "the stalled client was never disconnected"
        time.sleep(0.1)
    while metrics["vllm:num_requests_running"] or metrics["vllm:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, f"its requests were not aborted: {metrics}"
        metrics = read_metrics(url)
    sock.close()
    # Aborted, not finished: the engine stopped before every choice had its 900 tokens.
    assert metrics[GENERATED] - before[GENERATED] < NUM_CHOICES * MAX_TOKENS
    assert "--send-timeout" in strict_server.log()


def test_a_client_that_reads_gets_everything(strict_server: InProcessServer) -> None:
    before = read_metrics(strict_server.url)[DISCONNECTED]
    sock = send_request(strict_server.port, {**HEAVY, "n": 8}, receive_buffer=65536)
    received = b""
    while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, f"closed before the end: {received[-300:]!r}"
        received += chunk
    sock.close()
    assert received.count(b'"finish_reason":"length"') == 8
    assert read_metrics(strict_server.url)[DISCONNECTED] == before


class FakeTransport(asyncio.Transport):
    """A transport whose send buffer the test fills and drains by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.buffered_bytes = 0
        self.is_aborted = False

    def get_extra_info(self, name: str, default=None):
        return default

    def get_write_buffer_size(self) -> int:
        return self.buffered_bytes

    def is_closing(self) -> bool:
        return self.is_aborted

    def abort(self) -> None:
        self.is_aborted = True

    def close(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def no_app(scope, receive, send) -> None: ...


class Timer:
    """One `call_later` of ManualClock: its deadline and callback, until cancelled."""

    def __init__(self, when: float, callback, args: tuple) -> None:
        self.when, self.callback, self.args = when, callback, args
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True


class ManualClock:
    """The protocol's event loop, as far as its timers go: time passes when the test says."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[Timer] = []

    def call_later(self, delay: float, callback, *args) -> Timer:
        timer = Timer(self.now + delay, callback, args)
        self._timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        """Move time on by `seconds`, running every timer that falls due, in deadline order."""
        end = self.now + seconds
        while due := [t for t in self._timers if not t.is_cancelled and t.when <= end]:
            timer = min(due, key=lambda t: t.when)
            self._timers.remove(timer)
            self.now = timer.when
            timer.callback(*timer.args)
        self.now = end


def test_the_send_timeout_waits_while_the_client_reads() -> None:
    config = uvicorn.Config(app=no_app)
    config.load()
    protocol_class = timed_h11_protocol(header_timeout_s=60, send_timeout_s=0.2)

    def connected(clock: ManualClock) -> tuple[FakeTransport, object]:
        protocol = protocol_class(config, ServerState(), {}, _loop=clock)
        transport = FakeTransport()
        protocol.connection_made(transport)
        return transport, protocol

    clock = ManualClock()
    transport, protocol = connected(clock)
    transport.buffered_bytes = 1_000_000
    protocol.pause_writing()  # the buffer is full
    for _ in range(4):  # 0.6 s: the client reads a little in every period of 0.2 s
        clock.advance(0.15)
        transport.buffered_bytes -= 1000
    assert not transport.is_aborted
    clock.advance(0.5)  # then nothing for longer than the timeout
    assert transport.is_aborted
    protocol.connection_lost(None)

    clock = ManualClock()
    transport, protocol = connected(clock)
    protocol.pause_writing()
    clock.advance(0.1)
    protocol.resume_writing()  # drained in time: no abort
    clock.advance(0.3)
    assert not transport.is_aborted
    protocol.connection_lost(None)


def answer_and_close(port: int, request: bytes) -> tuple[bytes, bool]:
    """What the server answers to `request`, sent in one write, and whether it then closed the
    connection (a live one would answer a second request)."""
    sock = connect(port)
    sock.sendall(request)
    answer = sock.recv(65536)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        rest = sock.recv(65536)
        while rest and not rest.startswith(b"HTTP/1.1"):
            rest = sock.recv(65536)
    except (BrokenPipeError, ConnectionResetError):
        rest = b""
    sock.close()
    return answer, not rest


def test_a_request_with_both_transfer_encoding_and_content_length_is_refused(
    server: InProcessServer,
) -> None:
    # RFC 9112 §6.3: such a message may be a smuggling attempt; the connection must be closed.
    request = (
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    answer, closed = answer_and_close(server.port, request)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    assert closed


@pytest.mark.parametrize(
    "fields",
    [
        b"X-Big: " + b"a" * 118_000 + b"\r\n",
        b"".join(b"X-%d: %s\r\n" % (i, b"b" * 90) for i in range(200)),  # 20 KB in small fields
    ],
    ids=["one big field", "many fields"],
)
def test_headers_over_16_kib_are_refused_however_they_arrive(
    server: InProcessServer, fields: bytes
) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n"
    answer, closed = answer_and_close(server.port, request)
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), answer[:100]
    assert closed
    under = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 15_000 + b"\r\n\r\n"
    answer, closed = answer_and_close(server.port, under)
    assert answer.startswith(b"HTTP/1.1 200") and not closed
