"""Reading bodies: strict JSON and media type, a deadline for the body, and a client that leaves
mid-body counted as a disconnect (no traceback)."""

from __future__ import annotations

import socket
import sys
import time

import pytest
from servers import InProcessServer, read_metrics

from nanoserve.server.errors import APIError
from nanoserve.server.json_depth import MAX_JSON_DEPTH
from nanoserve.server.openai.api_models import ChatCompletionRequest, CompletionRequest
from nanoserve.server.request_body import check_media_type, parse_json_body

DISCONNECTED = "vllm:http_requests_client_disconnected_total"


@pytest.mark.parametrize(
    "content_type",
    [None, "", "application/json", "application/json; charset=utf-8", "Application/JSON",
     "application/vnd.api+json"],
)  # fmt: skip
def test_json_media_types(content_type: str | None) -> None:
    check_media_type(content_type)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
     "application/xml", "text/json", "application/jsonx"],
)  # fmt: skip
def test_other_media_types_are_415(content_type: str) -> None:
    with pytest.raises(APIError, match="must be JSON") as info:
        check_media_type(content_type)
    assert info.value.status_code == 415


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (rb'{"prompt": "\ud800"}', "lone UTF-16 surrogates"),
        (b'{"prompt": "\xed\xa0\x80"}', "not valid JSON"),
        (b'{"prompt": "a", "temperature": 1e999}', "Number out of range"),
        (b'{"prompt": "a", "temperature": NaN}', "not valid JSON"),
        (b'{"prompt": "a", "temperature": "-Infinity"}', "finite number"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'"a"', "must be a JSON object"),
    ],
)
def test_strict_json(body: bytes, message: str) -> None:
    with pytest.raises(APIError, match=message) as info:
        parse_json_body(body, CompletionRequest)
    assert info.value.status_code == 400


def kwargs_body(levels: int) -> bytes:
    """A chat body whose template kwargs hold a value `levels` lists deep (the body: 2 more)."""
    value = "[" * levels + "]" * levels
    return (
        f'{{"messages": [{{"role": "user", "content": "x"}}], "chat_template_kwargs": '
        f'{{"v": {value}}}}}'
    ).encode()


@pytest.mark.parametrize("recursion_limit", [1000, 20_000])
def test_the_nesting_bound_does_not_depend_on_the_recursion_limit(recursion_limit: int) -> None:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)  # torch.compile's inductor raises it past 2,000
    try:
        for levels in (MAX_JSON_DEPTH - 1, 900, 5000):
            with pytest.raises(APIError, match=f"at most {MAX_JSON_DEPTH} levels") as info:
                parse_json_body(kwargs_body(levels), ChatCompletionRequest)
            assert info.value.status_code == 400
        deepest = parse_json_body(kwargs_body(MAX_JSON_DEPTH - 2), ChatCompletionRequest)
        assert deepest.chat_template_kwargs is not None
    finally:
        sys.setrecursionlimit(old)


def test_a_valid_body() -> None:
    request = parse_json_body(rb'{"prompt": "\ud83d\ude00", "n": 2}', CompletionRequest)
    assert (request.prompt, request.n) == ("\U0001f600", 2)


def post_head(port: int, content_length: int, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    )
    sock.sendall(head.encode() + first_bytes)
    return sock


def read_all(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_body_that_never_arrives_is_408_then_closed(strict_server: InProcessServer) -> None:
    started = time.monotonic()
    sock = post_head(strict_server.port, 1000, b'{"prompt": ')  # --body-timeout 1
    answer = read_all(sock)  # ends: the server closes the connection after the answer
    elapsed = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in answer.lower() and b"--body-timeout" in answer
    assert 0.9 < elapsed < 10


def wait_for_handlers(server: InProcessServer, is_expected) -> None:
    deadline = time.monotonic() + 10
    while not is_expected(server.num_requests_in_handlers()):
        assert time.monotonic() < deadline, server.num_requests_in_handlers()
        time.sleep(0.005)  # paces the poll


def test_leaving_mid_body_is_a_disconnect(strict_server: InProcessServer) -> None:
    before = read_metrics(strict_server.url)[DISCONNECTED]
    for _ in range(5):
        wait_for_handlers(strict_server, lambda n: n == 0)  # the last one was handled
        sock = post_head(strict_server.port, 1000, b'{"prompt": "abc')
        # Leave once its handler reads the body (before that it is no request yet).
        wait_for_handlers(strict_server, lambda n: n == 1)
        sock.close()
    deadline = time.monotonic() + 10
    while read_metrics(strict_server.url)[DISCONNECTED] < before + 5:
        assert time.monotonic() < deadline, "the disconnects were not counted"
        time.sleep(0.05)
    log = strict_server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "unhandled error" not in log, log[-2000:]
