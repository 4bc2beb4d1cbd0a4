"""Calls forced by structured output: `required` (an array of calls) and a named function."""

from __future__ import annotations

import pytest
from conftest import check_consistent, run_parser

from nanoserve.server.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallParser


def test_required_reads_an_array_of_name_and_parameters(piece) -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    parser = RequiredToolCallParser()
    streamed = run_parser(parser, text, piece)
    assert [(c.name, c.arguments) for c in parser.calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert parser.content is None
    check_consistent(parser, streamed)


@pytest.mark.parametrize(
    "cut",
    [
        '[{"name": "a", "parameters": {}}, {"na',
        '[{"name": "a", "parameters": {}}, {"name": "b", "pa',
    ],
    ids=["before the second name", "after it"],
)
def test_required_cut_off_keeps_the_complete_calls_and_no_fragment(cut: str, piece) -> None:
    parser = RequiredToolCallParser()
    streamed = run_parser(parser, cut, piece)
    assert [(c.name, c.arguments) for c in parser.calls] == [("a", "{}")]
    assert parser.content is None and streamed.content == ""


def test_required_cut_inside_the_first_call_has_no_call_and_no_content(piece) -> None:
    parser = RequiredToolCallParser()
    streamed = run_parser(parser, '[{"name": "a", "parameters": {"x":', piece)
    assert parser.calls == [] and parser.content is None and streamed.content == ""


def test_required_drops_a_call_nested_1000_deep(piece) -> None:
    deep = "[" * 1000 + "]" * 1000
    text = f'[{{"name": "a", "parameters": {{}}}}, {{"name": "b", "parameters": {{"x": {deep}}}}}]'
    parser = RequiredToolCallParser()
    streamed = run_parser(parser, text, piece)
    assert [c.name for c in parser.calls] == ["a"]
    assert parser.content is None and streamed.content == ""


def test_named_streams_the_whole_output_as_arguments(piece) -> None:
    parser = NamedToolCallParser("lookup")
    streamed = run_parser(parser, '{"id": 7, "tags": ["a"]}', piece)
    assert [(c.name, c.arguments) for c in parser.calls] == [("lookup", '{"id": 7, "tags": ["a"]}')]
    check_consistent(parser, streamed)


@pytest.mark.parametrize(
    "text",
    ['{"id": 7, "ta', '{"a": ' + "[" * 1000 + "]" * 1000 + "}", '{"a": ' + "[" * 1000],
    ids=["cut off", "1000 deep", "1000 deep, cut off"],
)
def test_named_arguments_cut_off_or_too_deep_are_no_call_and_no_content(text: str, piece) -> None:
    parser = NamedToolCallParser("lookup")
    streamed = run_parser(parser, text, piece)
    assert parser.calls == [] and parser.content is None and streamed.content == ""
