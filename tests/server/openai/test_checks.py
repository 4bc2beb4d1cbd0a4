"""The engine trusts the requests it is sent: everything it would refuse (an empty prompt, one
that fills the context, token ids outside the vocabulary, stop ids and logit_bias keys outside
it) is a 400 from the front that names the field, on every path that reaches the engine
(completions, chat, the Responses API), and the server serves on unharmed."""

from __future__ import annotations

from typing import Protocol

import httpx
import pytest

C, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
OUT_OF_VOCAB = 100_000  # the tiny model's vocabulary is far smaller


class Served(Protocol):
    url: str


# (name, path, body, param); `server` serves 1024 positions.
REFUSED = [
    ("empty text prompt", C, {"prompt": ""}, "prompt"),
    ("empty token prompt in a batch", C, {"prompt": [[1, 2], []]}, "prompt"),
    ("negative token id", C, {"prompt": [5, -1]}, "prompt"),
    ("token id past the vocabulary", C, {"prompt": [5, OUT_OF_VOCAB]}, "prompt"),
    ("prompt that fills the context", C, {"prompt": "a" * 1024}, "prompt"),
    (
        "stop id past the vocabulary",
        C,
        {"prompt": "a", "stop_token_ids": [OUT_OF_VOCAB]},
        "stop_token_ids",
    ),
    (
        "logit_bias key past the vocabulary",
        C,
        {"prompt": "a", "logit_bias": {str(OUT_OF_VOCAB): 1}},
        "logit_bias",
    ),
    (
        "chat prompt that fills the context",
        CHAT,
        {"messages": [{"role": "user", "content": "a" * 1100}]},
        "messages",
    ),
    (
        "chat stop id past the vocabulary",
        CHAT,
        {"messages": USER, "stop_token_ids": [OUT_OF_VOCAB]},
        "stop_token_ids",
    ),
    (
        "chat logit_bias key past the vocabulary",
        CHAT,
        {"messages": USER, "logit_bias": {str(OUT_OF_VOCAB): -1}},
        "logit_bias",
    ),
    ("responses input that fills the context", RESPONSES, {"input": "a" * 1100}, "input"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [row[1:] for row in REFUSED], ids=[row[0] for row in REFUSED]
)
def test_what_the_engine_would_refuse_is_a_400_from_the_front(
    server: Served, path: str, body: dict, param: str
) -> None:
    response = httpx.post(f"{server.url}{path}", json={"max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_template_that_renders_nothing_is_an_empty_prompt(trusting_server: Served) -> None:
    body = {"messages": USER, "chat_template": "{{ '' }}", "max_tokens": 2}
    response = httpx.post(f"{trusting_server.url}{CHAT}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "is empty" in error["message"]


def test_the_server_serves_on_after_them(server: Served) -> None:
    for _, path, body, _ in REFUSED:
        httpx.post(f"{server.url}{path}", json={"max_tokens": 2, **body}, timeout=60)
    ok = httpx.post(f"{server.url}{C}", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# Logprob entries: n x (prompt tokens x (prompt_logprobs + 1) + max_tokens x (logprobs + 1)),
# at most 2^20 (1,048,576) per request; the error names the side that holds more of them.
PROMPT_600 = [5] * 600
LOGPROBS_REFUSED = [
    (
        "completion logprobs",  # 64 x 900 x 21 = 1,209,600
        C,
        {"prompt": "x", "n": 64, "logprobs": 20, "max_tokens": 900, "ignore_eos": True},
        "logprobs",
    ),
    (
        "chat logprobs",
        CHAT,
        {"messages": USER, "n": 64, "logprobs": True, "top_logprobs": 20, "max_tokens": 900},
        "logprobs",
    ),
    (
        "prompt and completion logprobs together",  # 50 x (599 + 424) x 21 = 1,074,150
        C,
        {"prompt": PROMPT_600, "n": 50, "prompt_logprobs": 20, "logprobs": 20, "max_tokens": 424},
        "prompt_logprobs",  # the larger side: 628,950 entries
    ),
    (
        "prompt logprobs",  # 64 x 1,000 x 21 = 1,344,000
        C,
        {"prompt": [5] * 1001, "n": 64, "prompt_logprobs": 20, "max_tokens": 1},
        "prompt_logprobs",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [row[1:] for row in LOGPROBS_REFUSED],
    ids=[row[0] for row in LOGPROBS_REFUSED],
)
def test_logprobs_past_the_bound_are_a_400_before_generating(
    server: Served, path: str, body: dict, param: str
) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and "the limit is 1048576" in error["message"], error


MANY = [{"role": "user", "content": ""}] * 10_001
TOOL = {"type": "function", "function": {"name": "f"}}
LONG_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "1" * 100_000}}
# (name, path, body, param, what the message says); `server` takes about 12,000 characters.
UNRENDERED = [
    ("10,001 chat messages", CHAT, {"messages": MANY}, "messages", "at most 10000 messages"),
    ("10,001 messages to /tokenize", "/tokenize", {"messages": MANY}, "messages", "at most 10000"),
    ("10,001 input items", RESPONSES, {"input": MANY}, "input", "at most 10000 messages"),
    (
        "10,001 content parts",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 10_001}]},
        "messages",
        "1 messages and 10001 parts",
    ),
    (
        "10,001 input parts",
        RESPONSES,
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": ""}] * 10_001}]},
        "input",
        "1 messages and 10001 parts",
    ),
    ("10,001 tools", CHAT, {"messages": USER, "tools": [TOOL] * 10_001}, "tools", "at most 10000"),
    (
        "10,001 Responses tools",
        RESPONSES,
        {"input": "hi", "tools": [{"type": "function", "name": "f"}] * 10_001},
        "tools",
        "at most 10000",
    ),
    (
        "a tool call's long arguments",
        CHAT,
        {"messages": [*USER, {"role": "assistant", "tool_calls": [LONG_CALL]}]},
        "messages",
        "messages: 100",
    ),
    (
        "a long extra key to /tokenize",
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi", "name": "n" * 100_000}]},
        "messages",
        "messages: 100",
    ),
    (
        "a long template variable",
        CHAT,
        {"messages": USER, "chat_template_kwargs": {"x": "a" * 100_000}},
        "chat_template_kwargs",
        "chat_template_kwargs: 100",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [row[1:] for row in UNRENDERED],
    ids=[row[0] for row in UNRENDERED],
)
def test_conversations_are_counted_and_measured_before_the_template_renders_them(
    server: Served, path: str, body: dict, param: str, says: str
) -> None:
    response = httpx.post(f"{server.url}{path}", json={"max_tokens": 2, **body}, timeout=30)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop_token_ids", [5] * 262_145),
        ("logit_bias", {str(i): 1 for i in range(262_145)}),
    ],
)
@pytest.mark.parametrize("path", [C, CHAT])
def test_token_id_lists_are_counted_before_they_are_read(
    server: Served, path: str, field: str, value: object
) -> None:
    # Sorting and checking four million stop ids held the event loop for seconds.
    body = {"prompt": "a"} if path == C else {"messages": USER}
    response = httpx.post(
        f"{server.url}{path}", json={**body, field: value, "max_tokens": 2}, timeout=30
    )
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == field and "at most 262144 token ids" in error["message"], error
