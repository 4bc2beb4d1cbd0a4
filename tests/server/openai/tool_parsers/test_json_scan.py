"""CallScanner bounds what it reads: a call nested deeper than MAX_JSON_DEPTH is malformed as
soon as it gets there, so no parser hands `json.loads` (recursive) a deep call, whatever the
process's recursion limit; every family parser then treats it as any malformed call: text. A
key that is not valid JSON is malformed too, and a call's length costs linear time."""

from __future__ import annotations

import time

import pytest
from conftest import run_parser

from nanoserve.server.json_depth import MAX_JSON_DEPTH
from nanoserve.server.openai.tool_parsers import TOOL_PARSERS
from nanoserve.server.openai.tool_parsers.json_scan import CallScanner

DEEP = 1000  # past Python's default recursion limit: json.loads raises RecursionError


def call(levels: int) -> str:
    """A well-formed call whose arguments hold `levels` nested lists."""
    return '{"name": "f", "arguments": {"a": ' + "[" * levels + "]" * levels + "}}"


def test_a_call_at_the_depth_limit_is_read() -> None:
    scanner = CallScanner()
    text = call(MAX_JSON_DEPTH - 2)  # the object and its arguments are two levels
    assert scanner.feed(text) == len(text)
    assert scanner.parsed() == ("f", '{"a": ' + text[len('{"name": "f", "arguments": {"a": ') : -1])


def test_a_call_one_level_deeper_is_malformed_where_it_gets_too_deep() -> None:
    scanner = CallScanner()
    text = call(MAX_JSON_DEPTH - 1)
    consumed = scanner.feed(text)
    assert scanner.is_malformed and scanner.parsed() is None
    assert text[:consumed].count("[") + 2 == MAX_JSON_DEPTH + 1  # it stopped at that bracket


def test_brackets_inside_strings_are_not_depth() -> None:
    scanner = CallScanner()
    text = '{"name": "f", "arguments": {"a": "' + "[{" * DEEP + '"}}'
    scanner.feed(text)
    assert scanner.parsed() == ("f", '{"a": "' + "[{" * DEEP + '"}')


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", f"<tool_call>\n{call(DEEP)}\n</tool_call>"),
        ("llama3_json", call(DEEP)),
        ("mistral", f"[TOOL_CALLS][{call(DEEP)}]"),
    ],
    ids=["hermes", "llama3_json", "mistral"],
)
def test_a_1000_deep_call_is_text_never_a_recursion_error(family: str, text: str, piece) -> None:
    parser = TOOL_PARSERS[family]()
    streamed = run_parser(parser, text, piece)
    assert parser.calls == []
    assert parser.content == text.strip() == streamed.content


@pytest.mark.parametrize("family", ["hermes", "mistral"])
def test_a_key_with_an_invalid_escape_is_a_malformed_call(family: str, piece) -> None:
    prefix = "<tool_call>\n" if family == "hermes" else "[TOOL_CALLS]["
    text = prefix + r'{"na\qme": "f", "arguments": {}}'
    parser = TOOL_PARSERS[family]()
    run_parser(parser, text, piece)
    assert parser.calls == [] and parser.content == text


def test_a_million_character_call_costs_time_in_proportion_to_its_length() -> None:
    arguments = '{"a": "' + "x" * 1_000_000 + '"}'
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    parser = TOOL_PARSERS["hermes"]()
    started = time.perf_counter()
    streamed = run_parser(parser, text, 4)  # as a model streams it: a few characters a token
    elapsed_s = time.perf_counter() - started
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", arguments)]
    assert streamed.arguments == {0: arguments}
    assert elapsed_s < 30  # about 2 s here; reading it again per piece took minutes
