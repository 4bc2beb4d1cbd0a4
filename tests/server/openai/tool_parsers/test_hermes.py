"""Hermes / Qwen `<tool_call>` output, written by hand from the Qwen2.5/Qwen3 template's format."""

from __future__ import annotations

import json

from conftest import check_consistent, run_parser

from nanoserve.server.openai.tool_parsers.hermes import HermesToolParser

ONE_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)


def test_one_call(piece) -> None:
    parser = HermesToolParser()
    streamed = run_parser(parser, ONE_CALL, piece)
    assert parser.content is None
    [call] = parser.calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert call.arguments == '{"city": "Paris", "unit": "celsius"}'  # exactly as written
    assert call.id.startswith("chatcmpl-tool-")
    check_consistent(parser, streamed)


def test_content_then_two_calls_with_nested_arguments(piece) -> None:
    text = (
        "Let me check both.\n\n"
        '<tool_call>\n{"name": "a", "arguments": {"q": "x } < y", "n": [1, {"k": null}]}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"arguments": {"flag": true}, "name": "b"}\n</tool_call>'
    )
    parser = HermesToolParser()
    streamed = run_parser(parser, text, piece)
    assert parser.content == "Let me check both."
    assert [c.name for c in parser.calls] == ["a", "b"]
    assert json.loads(parser.calls[0].arguments) == {"q": "x } < y", "n": [1, {"k": None}]}
    assert parser.calls[1].arguments == '{"flag": true}'
    check_consistent(parser, streamed)


def test_missing_end_tag_at_the_end_still_counts(piece) -> None:
    parser = HermesToolParser()
    streamed = run_parser(parser, '<tool_call>{"name": "f", "arguments": {}}', piece)
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", "{}")]
    check_consistent(parser, streamed)


def test_plain_text_and_a_lookalike_tag_stay_content(piece) -> None:
    text = "Use <tool> or <tool_c to call. Done."
    parser = HermesToolParser()
    streamed = run_parser(parser, text, piece)
    assert parser.content == text and parser.calls == []
    check_consistent(parser, streamed)


def test_malformed_calls_come_back_as_text(piece) -> None:
    bad = [
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": "a string"}\n</tool_call>',
        '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut off
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    ]
    for text in bad:
        parser = HermesToolParser()
        run_parser(parser, text, piece)
        assert parser.calls == [], text
        assert (parser.content or "").replace("\n", "") == text.replace("\n", ""), text


def test_a_good_call_survives_a_bad_one(piece) -> None:
    text = '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    parser = HermesToolParser()
    run_parser(parser, text, piece)
    assert [c.name for c in parser.calls] == ["ok"]
    assert parser.content == "<tool_call>{oops}</tool_call>"
