"""Never a 500: the real server under schemathesis (every route's documented request schema,
valid and invalid bodies), under a corpus of hostile bodies of our own, and under a
property-based fuzz of the structured-output and tool fields, whose every 200 must satisfy its
constraint.

Each part is bounded: a fixed number of generated examples per route on a server whose short
context keeps every generation quick, a fixed corpus, a few constraint examples (a longer run is
marked slow). Afterwards the server must be healthy, with the same engine, nothing running, no
KV block in use and no traceback in its log.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hostile_constraints import CHAT, COMPLETIONS, ISSUE_CASES, USER
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from servers import InProcessServer, read_metrics

C, TOK, DETOK = COMPLETIONS, "/tokenize", "/detokenize"
JSON = {"Content-Type": "application/json"}
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
    # the hardening issue's constraints and tool calls (their own tests: test_constraint_limits.py,
    # test_sandbox.py, test_chat_tools.py)
    *[(case.name, case.path, case.body, {}, case.status) for case in ISSUE_CASES],
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


# ---- property-based: the structured-output and tool fields ----
#
# Constraints drawn from a grammar of small schemas, regexes, Lark grammars, choice lists and
# tool lists (plus hostile ones past the front's bounds, and garbage), sent to the real server:
# every answer is a 400 or an output its constraint accepts, checked by an independent judge
# (jsonschema, `re.fullmatch`, membership); afterwards the server is unharmed.

# 16 in the default run; NANOSERVE_FUZZ_EXAMPLES=150 fuzzes further (about 30 s more here).
CONSTRAINT_EXAMPLES = int(os.environ.get("NANOSERVE_FUZZ_EXAMPLES", "16"))
WORDS = st.text(alphabet="abcxyz019 _", min_size=1, max_size=4)
# Rust's regex syntax (llguidance) and Python's agree on these (not on \d: Unicode's digits, in
# two versions of Unicode).
ATOMS = st.one_of(WORDS.map(re.escape), st.sampled_from(["[a-c]", "[0-9]", "[xyz_]", "."]))
QUANTIFIERS = st.sampled_from(["", "?", "*", "+", "{2}", "{1,3}", "{0,2}"])
REGEXES = st.lists(
    st.lists(st.builds(lambda a, q: f"(?:{a}){q}", ATOMS, QUANTIFIERS), min_size=1, max_size=3).map(
        "".join
    ),
    min_size=1,
    max_size=3,
).map("|".join)
HOSTILE_SCHEMAS = st.sampled_from(
    [
        {"anyOf": [{"const": i} for i in range(2001)]},
        {
            "$ref": "#/$defs/d0",
            "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(200)},
        },
        json.loads('{"type": "array", "items": ' * 130 + "{}" + "}" * 130),
    ]
)


def objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """Object schemas over `children`: some properties, some of them required, no others."""
    properties = st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3)
    return properties.flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(required),
                "additionalProperties": False,
            }
        )
    )


LEAF_SCHEMAS = st.one_of(
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "number"}]),
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    REGEXES.map(lambda regex: {"type": "string", "pattern": regex}),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda words: {"enum": words}),
    WORDS.map(lambda word: {"const": word}),
)


def schemas(max_leaves: int) -> st.SearchStrategy[dict]:
    """Schemas of up to `max_leaves` leaves: arrays, objects and anyOf over them."""
    return st.recursive(
        LEAF_SCHEMAS,
        lambda children: st.one_of(
            st.builds(
                lambda items, n: {"type": "array", "items": items, "maxItems": n},
                children,
                st.integers(0, 3),
            ),
            objects(children),
            st.lists(children, min_size=2, max_size=3).map(lambda branches: {"anyOf": branches}),
        ),
        max_leaves=max_leaves,
    )


SCHEMAS = schemas(max_leaves=6)


@st.composite
def grammars(draw: st.DrawFn) -> tuple[str, str]:
    """A Lark grammar of literals and regex terminals, and the Python regex of its language."""
    lark, python = [], []
    for _ in range(draw(st.integers(1, 3))):
        pieces = draw(
            st.lists(
                st.one_of(WORDS.map(str), REGEXES.map(lambda regex: (regex,))),
                min_size=1,
                max_size=3,
            )
        )
        lark.append(
            " ".join(f"/{p[0]}/" if isinstance(p, tuple) else json.dumps(p) for p in pieces)
        )
        python.append(
            "".join(f"(?:{p[0]})" if isinstance(p, tuple) else re.escape(p) for p in pieces)
        )
    return "start: " + " | ".join(lark), "|".join(f"(?:{p})" for p in python)


@dataclass(frozen=True)
class Constrained:
    """A drawn request body, and how to judge a 200's output (None: garbage, only no 5xx)."""

    path: str
    body: dict
    kind: str  # json | regex | grammar | choice | tools | garbage
    judge: Any = None


@st.composite
def constrained_requests(draw: st.DrawFn) -> Constrained:
    kind = draw(st.sampled_from(["json", "regex", "grammar", "choice", "tools", "garbage"]))
    base = {"max_tokens": 48, "temperature": draw(st.sampled_from([0, 1.0])), "seed": 0}
    if kind == "tools":
        return draw(tool_requests(base))
    if kind == "json":
        value = draw(st.one_of(SCHEMAS, HOSTILE_SCHEMAS)) if draw(st.booleans()) else draw(SCHEMAS)
        judge: Any = value
    elif kind == "regex":
        value = judge = draw(st.one_of(REGEXES, st.just("a{1000000}"), st.just("(?:b|c){5}")))
    elif kind == "grammar":
        value, judge = draw(grammars())
    elif kind == "choice":
        nonempty = st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=5)
        value = judge = draw(st.one_of(nonempty, st.just([]), st.just(["a", ""])))
    else:  # a field of any kind holding any text
        kind_of = draw(st.sampled_from(["regex", "grammar", "json"]))
        return Constrained(
            COMPLETIONS,
            {**base, "prompt": "x", f"guided_{kind_of}": draw(st.text(max_size=12))},
            kind,
        )
    if draw(st.booleans()):
        return Constrained(
            COMPLETIONS, {**base, "prompt": "x", f"guided_{kind}": value}, kind, judge
        )
    body = {**base, "messages": USER, "structured_outputs": {kind: value}}
    return Constrained(CHAT, {**body, "stream": draw(st.booleans())}, kind, judge)


@st.composite
def tool_requests(draw: st.DrawFn, base: dict) -> Constrained:
    schemas = draw(st.lists(objects(SCHEMAS), min_size=1, max_size=4))
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
        for i, schema in enumerate(schemas)
    ]
    named = draw(st.none() | st.integers(0, len(tools) - 1))
    choice = (
        "required" if named is None else {"type": "function", "function": {"name": f"f{named}"}}
    )
    body = {**base, "max_tokens": 96, "messages": USER, "tools": tools, "tool_choice": choice}
    return Constrained(CHAT, {**body, "stream": draw(st.booleans())}, "tools", (tools, named))


@pytest.fixture(scope="module")
def constraint_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    """The tiny model with a template that shows no tools: any tool list leaves room to answer."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    flags = ("--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with InProcessServer(tiny_model, log, *flags) as server:
        yield server


def answer(server: InProcessServer, request: Constrained) -> tuple[int, list[dict]]:
    """The status and each choice's {"text", "tool_calls", "finish_reason"}, streamed or not."""
    url = f"{server.url}{request.path}"
    if not request.body.get("stream"):
        response = httpx.post(url, json=request.body, timeout=120)
        if response.status_code != 200:
            return response.status_code, []
        choices = response.json()["choices"]
        if request.path == COMPLETIONS:
            return 200, [{"text": c["text"], "finish_reason": c["finish_reason"]} for c in choices]
        return 200, [
            {**c["message"], "text": c["message"]["content"], "finish_reason": c["finish_reason"]}
            for c in choices
        ]
    with httpx.stream("POST", url, json=request.body, timeout=120) as response:
        if response.status_code != 200:
            return response.status_code, []
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in chunk for chunk in chunks), chunks[-1]
    text, calls, finish_reason = "", {}, None
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        text += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
            call["name"] += piece["function"].get("name") or ""
            call["arguments"] += piece["function"].get("arguments") or ""
        finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
    tool_calls = [{"function": calls[i]} for i in sorted(calls)]
    return 200, [{"text": text or None, "tool_calls": tool_calls, "finish_reason": finish_reason}]


def judge(request: Constrained, choice: dict) -> None:
    """The output satisfies its constraint (a finished one; a cut one where that is checkable)."""
    kind, text, finish_reason = request.kind, choice["text"] or "", choice["finish_reason"]
    if kind == "tools":
        judge_tool_calls(request, choice)
    elif kind == "choice":
        assert finish_reason == "stop" and text in request.judge, (text, request.judge)
    elif finish_reason != "stop" or request.judge is None:
        return  # cut off by max_tokens: a prefix; garbage: only no 5xx
    elif kind == "json":
        jsonschema.validate(json.loads(text), request.judge)
    else:
        assert re.fullmatch(request.judge, text), (text, request.judge)


def judge_tool_calls(request: Constrained, choice: dict) -> None:
    """Forced calls: no content; every call (streamed: every one the message kept) valid."""
    tools, named = request.judge
    assert not choice["text"], choice
    calls = choice.get("tool_calls") or []
    if request.body.get("stream") and choice["finish_reason"] == "length":
        calls = calls[:-1]  # the stream showed the start of the call that was cut
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        assert named is None or name == f"f{named}", (name, named)
        schema = tools[int(name.removeprefix("f"))]["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)


def check_constrained(server: InProcessServer, request: Constrained) -> None:
    status, choices = answer(server, request)
    assert status in (200, 400), (status, request)
    for choice in choices:
        event(f"{request.kind}: {choice['finish_reason']}")  # --hypothesis-show-statistics
        judge(request, choice)
    if not choices:
        event(f"{request.kind}: {status}")


FUZZ_SETTINGS = {
    "deadline": timedelta(seconds=60),  # one example: a compile (probe) and 96 tokens at most
    "database": None,
    "suppress_health_check": list(HealthCheck),
}


@given(request=constrained_requests())
@settings(max_examples=CONSTRAINT_EXAMPLES, **FUZZ_SETTINGS)
def test_constrained_outputs_satisfy_their_constraint(
    constraint_server: InProcessServer, request: Constrained
) -> None:
    check_constrained(constraint_server, request)


def test_the_constraint_fuzzed_server_is_unharmed(constraint_server: InProcessServer) -> None:
    assert_unharmed(constraint_server, constraint_server.engine_ids())
