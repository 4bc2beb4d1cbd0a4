"""Llama 3.1/3.2 JSON tool calls, written by hand from Meta's JSON tool-calling format."""

from __future__ import annotations

import json

from conftest import check_consistent, run_parser

from nanoserve.server.openai.tool_parsers.llama3_json import Llama3JsonToolParser


def test_one_call_with_parameters(piece) -> None:
    text = '{"name": "get_weather", "parameters": {"location": "Tokyo", "days": 3}}'
    parser = Llama3JsonToolParser()
    streamed = run_parser(parser, text, piece)
    assert parser.content is None
    [call] = parser.calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"location": "Tokyo", "days": 3}
    check_consistent(parser, streamed)


def test_python_tag_and_several_calls_joined_by_semicolons(piece) -> None:
    text = (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
        '{"name": "b", "arguments": {"y": "two; three"}}'
    )
    parser = Llama3JsonToolParser()
    streamed = run_parser(parser, text, piece)
    assert [(c.name, c.arguments) for c in parser.calls] == [
        ("a", '{"x": 1}'),
        ("b", '{"y": "two; three"}'),
    ]
    check_consistent(parser, streamed)


def test_text_that_does_not_start_with_a_call_is_content(piece) -> None:
    text = 'The answer is {"name": "x", "parameters": {}} as JSON.'
    parser = Llama3JsonToolParser()
    streamed = run_parser(parser, text, piece)
    assert parser.calls == [] and parser.content == text
    check_consistent(parser, streamed)


def test_malformed_calls_come_back_as_text(piece) -> None:
    for text in [
        '{"name": "f", "parameters": [1, 2]}',
        '{"name": "f" "parameters": {}}',
        '{"parameters": {}}',
        '{"name": "f", "parameters": {"a":',
    ]:
        parser = Llama3JsonToolParser()
        run_parser(parser, text, piece)
        assert parser.calls == [] and parser.content == text, text
