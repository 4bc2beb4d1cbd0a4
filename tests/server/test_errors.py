"""Bad requests: each gets the right 4xx and an OpenAI error body; the server stays unchanged."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from servers import InProcessServer, ServerProcess, read_metrics

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (name, method, path, body: dict or raw bytes, status, param or None)
BAD_REQUESTS = [
    ("malformed json", "POST", C, b'{"prompt": "a",', 400, None),
    ("json array body", "POST", C, b"[1, 2]", 400, None),
    ("json string body", "POST", C, b'"hello"', 400, None),
    ("empty body", "POST", C, b"", 400, None),
    ("NaN", "POST", C, b'{"prompt": "a", "temperature": NaN}', 400, None),
    ("not utf-8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("missing prompt", "POST", C, {"max_tokens": 5}, 400, "prompt"),
    ("prompt is a number", "POST", C, {"prompt": 5}, 400, "prompt"),
    ("prompt is an object", "POST", C, {"prompt": {"a": 1}}, 400, "prompt"),
    ("empty prompt", "POST", C, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "POST", C, {"prompt": []}, 400, "prompt"),
    ("negative token id", "POST", C, {"prompt": [-1, 5]}, 400, "prompt"),
    ("out-of-vocab token id", "POST", C, {"prompt": [100000]}, 400, "prompt"),
    ("empty token list in batch", "POST", C, {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("bool token ids", "POST", C, {"prompt": [True, False]}, 400, "prompt"),
    ("max_tokens not a number", "POST", C, {"prompt": "a", "max_tokens": "abc"}, 400,
     "max_tokens"),
    ("max_tokens 0", "POST", C, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens -1 with echo", "POST", C,
     {"prompt": "a", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("prompt_logprobs negative", "POST", C,
     {"prompt": "a", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("prompt_logprobs streamed", "POST", C,
     {"prompt": "a", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs"),
    ("prompt logprobs too many", "POST", C,
     {"prompt": "a" * 900, "max_tokens": 1, "n": 128, "echo": True, "logprobs": 20}, 400,
     "prompt_logprobs"),
    ("max_tokens negative", "POST", C, {"prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
    ("temperature negative", "POST", C, {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("temperature a word", "POST", C, {"prompt": "a", "temperature": "hot"}, 400,
     "temperature"),
    ("top_p 0", "POST", C, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_p over 1", "POST", C, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("top_k -2", "POST", C, {"prompt": "a", "top_k": -2}, 400, "top_k"),
    ("min_p 2", "POST", C, {"prompt": "a", "min_p": 2}, 400, "min_p"),
    ("presence_penalty 3", "POST", C, {"prompt": "a", "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("frequency_penalty -3", "POST", C, {"prompt": "a", "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("repetition_penalty 0", "POST", C, {"prompt": "a", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("n 0", "POST", C, {"prompt": "a", "n": 0}, 400, "n"),
    ("n huge", "POST", C, {"prompt": "a", "n": 100000}, 400, "n"),
    ("logprobs 50", "POST", C, {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("logprobs -1", "POST", C, {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("empty stop string", "POST", C, {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("stop a number", "POST", C, {"prompt": "a", "stop": 5}, 400, "stop"),
    ("negative stop token", "POST", C, {"prompt": "a", "stop_token_ids": [-1]}, 400,
     "stop_token_ids"),
    ("stop token out of vocab", "POST", C, {"prompt": "a", "stop_token_ids": [99999]}, 400,
     None),
    ("logit_bias key not an id", "POST", C, {"prompt": "a", "logit_bias": {"abc": 1}}, 400,
     "logit_bias"),
    ("logit_bias value 200", "POST", C, {"prompt": "a", "logit_bias": {"5": 200}}, 400,
     "logit_bias"),
    ("logit_bias id out of vocab", "POST", C, {"prompt": "a", "logit_bias": {"99999": 1}},
     400, None),
    ("seed a word", "POST", C, {"prompt": "a", "seed": "x"}, 400, "seed"),
    ("seed too big", "POST", C, {"prompt": "a", "seed": 2**70}, 400, "seed"),
    ("min_tokens negative", "POST", C, {"prompt": "a", "min_tokens": -1}, 400, "min_tokens"),
    ("min_tokens over max_tokens", "POST", C,
     {"prompt": "a", "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    ("prompt at the context", "POST", C, {"prompt": "a" * 1024}, 400, "prompt"),
    ("prompt over the context", "POST", C, {"prompt": "a" * 3000}, 400, "prompt"),
    ("prompt + max_tokens over", "POST", C, {"prompt": "a" * 1000, "max_tokens": 100}, 400,
     "max_tokens"),
    ("suffix without FIM tokens", "POST", C, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("unknown model", "POST", C, {"prompt": "a", "model": "gpt-5"}, 404, "model"),
    ("stream not a bool", "POST", C, {"prompt": "a", "stream": "maybe"}, 400, "stream"),
    ("stream_options a list", "POST", C, {"prompt": "a", "stream_options": [1]}, 400,
     "stream_options"),
    ("chat: no messages", "POST", CHAT, {"max_tokens": 5}, 400, "messages"),
    ("chat: empty messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("chat: messages a string", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("chat: message without role", "POST", CHAT, {"messages": [{"content": "hi"}]}, 400,
     "messages.0.role"),
    ("chat: content a number", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]},
     400, "messages.0.content"),
    ("chat: image part", "POST", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages"),
    ("chat: top_logprobs without logprobs", "POST", CHAT,
     {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat: top_logprobs 50", "POST", CHAT,
     {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "logprobs"),
    ("chat: reasoning_effort unknown", "POST", CHAT,
     {"messages": USER, "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ("chat: max_completion_tokens 0", "POST", CHAT,
     {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat: max_tokens 0", "POST", CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("chat: prompt_logprobs 21", "POST", CHAT,
     {"messages": USER, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("chat: prompt_logprobs streamed", "POST", CHAT,
     {"messages": USER, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("chat: max_tokens over the context", "POST", CHAT,
     {"messages": USER, "max_tokens": 5000}, 400, "max_tokens"),
    ("chat: chat_template_kwargs a string", "POST", CHAT,
     {"messages": USER, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
    ("chat: unknown model", "POST", CHAT, {"messages": USER, "model": "nope"}, 404, "model"),
    ("tokenize: nothing to tokenize", "POST", "/tokenize", {}, 400, "prompt"),
    ("detokenize: negative id", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detokenize: not a list", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("unknown route", "GET", "/v1/nothing", None, 404, None),
    ("wrong method", "GET", C, None, 405, None),
]  # fmt: skip


def test_the_table_is_big_enough() -> None:
    assert len(BAD_REQUESTS) >= 40


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [row[1:] for row in BAD_REQUESTS],
    ids=[row[0] for row in BAD_REQUESTS],
)
def test_bad_request(
    server: InProcessServer, method: str, path: str, body, status: int, param: str | None
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    if body is None:
        kwargs = {}
    response = httpx.request(method, f"{server.url}{path}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error


def test_context_length_message(server: InProcessServer) -> None:
    response = httpx.post(f"{server.url}{C}", json={"prompt": "a" * 1500}, timeout=30)
    message = response.json()["error"]["message"]
    assert message.startswith(
        "This model's maximum context length is 1024 tokens. However, your request has 1500 "
        "input tokens"
    )


def test_oversized_body_is_413(server: InProcessServer) -> None:
    """Refused on its Content-Length, before the body is read. (A client that insists on
    sending all 33 MB first, as httpx does, can find the connection closed before it reads the
    answer: the test reads it as a client that waits would.)"""
    size = 33 * 1024 * 1024
    head = (
        f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + b'{"prompt": "aaaa')
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"413", answer[:200]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == 413


def front_rss_bytes(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_a_huge_prompt_is_refused_before_tokenizing(front_process: ServerProcess) -> None:
    server = front_process  # what is measured is the memory of the front process
    before = front_rss_bytes(server)
    for path, body, num_chars in (
        (C, {"prompt": "a" * 30_000_000}, 30_000_000),
        (C, {"prompt": ["a", "b" * 30_000_000]}, 30_000_000),
        (CHAT, {"messages": [{"role": "user", "content": "c" * 30_000_000}]}, 30_000_004),
        ("/tokenize", {"prompt": "d" * 30_000_000}, 30_000_000),
    ):
        started = time.monotonic()
        response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert time.monotonic() - started < 20  # tokenizing it took 30+ s
        assert response.status_code == 400
        error = response.json()["error"]
        assert f"{num_chars} characters" in error["message"], error
        assert "--max-prompt-chars" in error["message"]
    # The front kept 3.2 GB after one such prompt when it tokenized them.
    assert front_rss_bytes(server) < before + 300 * 2**20


def test_server_is_healthy_and_unchanged_after_bad_requests(server: InProcessServer) -> None:
    engines = server.engine_ids()
    for _, method, path, body, _, _ in BAD_REQUESTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.request(method, f"{server.url}{path}", timeout=30, **(kwargs if body else {}))
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.engine_ids() == engines and len(engines) == 1
    ok = httpx.post(f"{server.url}{C}", json={"prompt": "a", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    metrics = read_metrics(server.url)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0


def test_odd_but_valid_values_are_served(server: InProcessServer) -> None:
    body = {
        "prompt": [[1, 2], [3]], "max_tokens": 3, "top_k": 10**12, "seed": -5, "n": 2,
        "temperature": 0.5, "min_tokens": 2, "stop": [], "unknown_field": {"x": 1},
        "logit_bias": {"5": -100}, "user": "me", "echo": True,
    }  # fmt: skip
    response = httpx.post(f"{server.url}{C}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 4


def test_null_max_tokens_means_the_rest_of_the_context(server: InProcessServer) -> None:
    body = {"prompt": "a" * 1020, "max_tokens": None, "ignore_eos": True}
    response = httpx.post(f"{server.url}{C}", json=body, timeout=60).json()
    assert response["usage"]["completion_tokens"] == 4
    assert response["choices"][0]["finish_reason"] == "length"
