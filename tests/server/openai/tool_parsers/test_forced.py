"""Calls forced by structured output: `required` (an array of calls) and a named function."""

from __future__ import annotations

from conftest import check_consistent, run_parser

from nanoserve.server.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallParser


def test_required_reads_an_array_of_name_and_parameters(piece) -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    parser = RequiredToolCallParser()
    streamed = run_parser(parser, text, piece)
    assert [(c.name, c.arguments) for c in parser.calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert parser.content is None
    check_consistent(parser, streamed)


def test_required_cut_off_is_text(piece) -> None:
    parser = RequiredToolCallParser()
    run_parser(parser, '[{"name": "a", "parameters": {"x":', piece)
    assert parser.calls == [] and parser.content == '[{"name": "a", "parameters": {"x":'


def test_named_streams_the_whole_output_as_arguments(piece) -> None:
    parser = NamedToolCallParser("lookup")
    streamed = run_parser(parser, '{"id": 7, "tags": ["a"]}', piece)
    assert [(c.name, c.arguments) for c in parser.calls] == [("lookup", '{"id": 7, "tags": ["a"]}')]
    check_consistent(parser, streamed)


def test_named_cut_off_is_text(piece) -> None:
    parser = NamedToolCallParser("lookup")
    run_parser(parser, '{"id": 7, "ta', piece)
    assert parser.calls == [] and parser.content == '{"id": 7, "ta'
