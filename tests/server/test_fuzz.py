"""Never a 500: the real server under schemathesis (every route's documented request schema,
valid and invalid bodies) and under a corpus of hostile bodies of our own.

Each part is bounded: a fixed number of generated examples per route on a server whose short
context keeps every generation quick, and a fixed corpus. Afterwards the server must be
healthy, with the same engine, nothing running, no KV block in use and no traceback in its log.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from servers import InProcessServer, read_metrics

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
JSON = {"Content-Type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
FUZZ_EXAMPLES_PER_ROUTE = 25
RECURSIVE_MACRO = "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}"


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def raw(text: str) -> bytes:
    return text.encode()


# (name, path, body: dict or raw bytes, extra headers, expected status)
HOSTILE = [
    ("lone high surrogate in a prompt", C, raw(r'{"prompt": "\ud800", "max_tokens": 1}'), {}, 400),
    ("lone low surrogate in a prompt", C, raw(r'{"prompt": "a\udc00", "max_tokens": 1}'), {}, 400),
    ("lone surrogate in a stop string", C,
     raw(r'{"prompt": "a", "stop": "\ud800", "max_tokens": 1}'), {}, 400),
    ("lone surrogate to /tokenize", TOK, raw(r'{"prompt": "\ud800"}'), {}, 400),
    ("lone surrogate in chat content", CHAT,
     raw(r'{"messages": [{"role": "user", "content": "\udbff"}]}'), {}, 400),
    ("lone surrogate as a kwargs key", CHAT,
     raw(r'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
         r'{"\ud800": 1}}'), {}, 400),
    ("surrogate as raw UTF-8 bytes", C, b'{"prompt": "\xed\xa0\x80"}', {}, 400),
    ("a real surrogate pair (emoji)", C,
     raw(r'{"prompt": "\ud83d\ude00", "max_tokens": 1}'), {}, 200),
    ("not UTF-8", C, b'{"prompt": "\xc3\x28"}', {}, 400),
    ("UTF-8 byte order mark", C, b'\xef\xbb\xbf{"prompt": "a"}', {}, 400),
    ("NUL characters", C, {"prompt": "a\x00b\x00", "max_tokens": 1}, {}, 200),
    ("message field 900 lists deep", CHAT,
     raw(f'{{"messages": [{{"role": "user", "content": "x", "extra": {deep(900)}}}]}}'), {}, 400),
    ("kwargs value 900 lists deep", CHAT,
     raw(f'{{"messages": [{{"role": "user", "content": "x"}}], '
         f'"chat_template_kwargs": {{"v": {deep(900)}}}}}'), {}, 400),
    ("content 900 lists deep", CHAT,
     raw(f'{{"messages": [{{"role": "user", "content": {deep(900)}}}]}}'), {}, 400),
    ("prompt 5000 lists deep", C, raw(f'{{"prompt": {deep(5000)}}}'), {}, 400),
    ("temperature 1e999", C, raw('{"prompt": "a", "temperature": 1e999}'), {}, 400),
    ("temperature -1e999", C, raw('{"prompt": "a", "temperature": -1e999}'), {}, 400),
    ("an integer of 5000 digits", C, raw('{"prompt": "a", "seed": 1' + "0" * 5000 + "}"), {}, 400),
    ("max_tokens 2^64", C, {"prompt": "a", "max_tokens": 2**64}, {}, 400),
    ("n 2^63", C, {"prompt": "a", "n": 2**63}, {}, 400),
    ("logprobs 2^70", C, {"prompt": "a", "logprobs": 2**70}, {}, 400),
    ("top_p 1e308", C, {"prompt": "a", "top_p": 1e308}, {}, 400),
    ("NaN literal", C, raw('{"prompt": "a", "top_p": NaN}'), {}, 400),
    ("Infinity literal", C, raw('{"prompt": "a", "top_p": Infinity}'), {}, 400),
    *[(f"temperature {word!r}", C, {"prompt": "a", "temperature": word}, {}, 400)
      for word in ("inf", "-inf", "nan", "NaN", "Infinity", "infinity")],
    ("presence_penalty 'nan'", CHAT, {"messages": USER, "presence_penalty": "nan"}, {}, 400),
    ("logit_bias value 'inf'", C, {"prompt": "a", "logit_bias": {"5": "inf"}}, {}, 400),
    *[(f"logit_bias key {key!r}", C, {"prompt": "a", "logit_bias": {key: 1}}, {}, 400)
      for key in (" 1 ", "1_0", "\u0661", "\uff19", "+1", "-1", "1e2", "0x10", "", "1.0")],
    ("text/plain", C, raw('{"prompt": "a"}'), {"Content-Type": "text/plain"}, 415),
    ("form-urlencoded (curl -d)", C, raw('{"prompt": "a"}'),
     {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("multipart", C, raw('{"prompt": "a"}'),
     {"Content-Type": "multipart/form-data; boundary=x"}, 415),
    ("xml", TOK, raw('{"prompt": "a"}'), {"Content-Type": "application/xml"}, 415),
    ("json with a charset", C, raw('{"prompt": "a", "max_tokens": 1}'),
     {"Content-Type": "application/json; charset=utf-8"}, 200),
    ("a +json media type", C, raw('{"prompt": "a", "max_tokens": 1}'),
     {"Content-Type": "application/vnd.api+json"}, 200),
    ("recursive template macro", CHAT, {"messages": USER, "chat_template": RECURSIVE_MACRO}, {},
     400),
    *[(f"chat_template_kwargs {key!r}", CHAT,
       {"messages": USER, "chat_template_kwargs": {key: value}}, {}, 400)
      for key, value in (
          ("chat_template", "/etc/passwd"), ("tokenize", True), ("tools", []),
          ("documents", []), ("conversation", []), ("messages", []),
          ("add_generation_prompt", False), ("continue_final_message", True),
          ("return_dict", True), ("tokenizer_kwargs", {}), ("return_tensors", "np"),
      )],
    ("tokenize: chat_template_kwargs chat_template", TOK,
     {"messages": USER, "chat_template_kwargs": {"chat_template": "/proc/self/environ"}}, {},
     400),
    ("top-level body an array", C, raw("[1]"), {}, 400),
    ("top-level body null", C, raw("null"), {}, 400),
    ("2049 prompts", C, {"prompt": [[5]] * 2049, "max_tokens": 1}, {}, 400),
    ("100,000 prompts", C, {"prompt": [[5]] * 100_000, "max_tokens": 1}, {}, 400),
    ("65 stop strings", C, {"prompt": "a", "stop": [str(i) for i in range(65)]}, {}, 400),
    ("a 10,000-character stop string", C, {"prompt": "a", "stop": "x" * 10_000}, {}, 400),
    ("100,000 repeated stop token ids", C,
     {"prompt": "a", "stop_token_ids": [5] * 100_000, "max_tokens": 2}, {}, 200),
    ("a 100,000-character model name", C, {"prompt": "a", "model": "m" * 100_000}, {}, 404),
    ("a text part without text", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, {}, 400),
    ("2 MB of prompt", C, {"prompt": "a" * 2_000_000}, {}, 400),
    ("detokenize 2^63", DETOK, {"tokens": [2**63]}, {}, 400),
    ("detokenize 2,048 ids", DETOK, {"tokens": [65] * 2048}, {}, 200),  # 2 x max_model_len
    ("detokenize 200,000 ids", DETOK, {"tokens": [65] * 200_000}, {}, 400),
]  # fmt: skip


def check_answer(response: httpx.Response, expected: int) -> None:
    assert response.status_code == expected, response.text[:300]
    if expected >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == expected


def assert_unharmed(server: InProcessServer, engines: list[int]) -> None:
    """Healthy, same engine, idle, and no traceback or unhandled error in the log."""
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert server.engine_ids() == engines
    metrics = read_metrics(server.url)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    log = server.log_path.read_text(errors="replace")
    for marker in ("Traceback", "Exception in ASGI application", "unhandled error"):
        assert marker not in log, log[-3000:]


def send(server: InProcessServer, path: str, body, headers: dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}", content=content, headers={**JSON, **headers}, timeout=60
    )


@pytest.mark.parametrize(
    ("path", "body", "headers", "expected"),
    [row[1:] for row in HOSTILE],
    ids=[row[0] for row in HOSTILE],
)
def test_hostile_body(server: InProcessServer, path: str, body, headers, expected: int) -> None:
    check_answer(send(server, path, body, headers), expected)


def test_the_server_is_unharmed_by_the_corpus(server: InProcessServer) -> None:
    engines = server.engine_ids()
    for _, path, body, headers, _ in HOSTILE:
        assert send(server, path, body, headers).status_code < 500
    assert_unharmed(server, engines)


def test_a_trusted_template_is_text_never_a_file(trusting_server: InProcessServer) -> None:
    url = trusting_server.url
    for path in ("/etc/passwd", "/proc/self/environ"):
        body = {"messages": USER, "chat_template": path}
        tokens = httpx.post(f"{url}{TOK}", json=body, timeout=30).json()["tokens"]
        text = httpx.post(f"{url}{DETOK}", json={"tokens": tokens}, timeout=30).json()["prompt"]
        assert text == path  # the template's text, rendered: the name itself, not the file
    recursive = {"messages": USER, "chat_template": RECURSIVE_MACRO, "max_tokens": 1}
    check_answer(httpx.post(f"{url}{CHAT}", json=recursive, timeout=30), 400)
    broken = {"messages": USER, "chat_template": "{% for %}", "max_tokens": 1}
    check_answer(httpx.post(f"{url}{CHAT}", json=broken, timeout=30), 400)


@pytest.fixture(scope="module")
def api_schema(trusting_server: InProcessServer):
    return schemathesis.openapi.from_url(f"{trusting_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES_PER_ROUTE,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_schemathesis_finds_no_server_error(case) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])


def test_the_fuzzed_server_is_unharmed(trusting_server: InProcessServer) -> None:
    assert_unharmed(trusting_server, trusting_server.engine_ids())
