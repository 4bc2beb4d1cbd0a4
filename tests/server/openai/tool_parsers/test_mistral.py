"""Mistral `[TOOL_CALLS][...]` output, written by hand from Mistral's function-calling format."""

from __future__ import annotations

import json

from conftest import check_consistent, run_parser

from nanoserve.server.openai.tool_parsers.mistral import MistralToolParser


def test_an_array_of_calls_after_content(piece) -> None:
    text = (
        'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "note", "arguments": {"text": "[x], {y}"}}]'
    )
    parser = MistralToolParser()
    streamed = run_parser(parser, text, piece)
    assert parser.content == "Sure."
    assert [c.name for c in parser.calls] == ["add", "note"]
    assert json.loads(parser.calls[1].arguments) == {"text": "[x], {y}"}
    check_consistent(parser, streamed)
    assert MistralToolParser.needs_special_tokens


def test_no_tool_calls_token_is_all_content(piece) -> None:
    parser = MistralToolParser()
    streamed = run_parser(parser, "Just [text] and {braces}.", piece)
    assert parser.calls == [] and parser.content == "Just [text] and {braces}."
    check_consistent(parser, streamed)


def test_malformed_calls_come_back_as_text(piece) -> None:
    for text in [
        "[TOOL_CALLS]not an array",
        '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
        "[TOOL_CALLS][1, 2]",
    ]:
        parser = MistralToolParser()
        run_parser(parser, text, piece)
        assert parser.calls == [], text
        assert parser.content is not None and "TOOL_CALLS" in parser.content, text
