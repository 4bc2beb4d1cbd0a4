"""Helpers for the parser tests: feed a string whole or in pieces, collect what streamed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from nanoserve.server.openai.tool_parsers import ToolParser


@dataclass
class Streamed:
    """Everything a parser emitted, put back together the way a client does."""

    content: str = ""
    names: dict[int, str] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)


def run_parser(parser: ToolParser, text: str, piece: int | None) -> Streamed:
    """Feed `text` in pieces of `piece` characters (None: all at once), then finish."""
    streamed = Streamed()
    size = piece or max(1, len(text))
    deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    for delta in [*deltas, parser.finish()]:
        streamed.content += delta.content
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index not in streamed.names, "a call's name is sent once"
                streamed.names[call.index] = call.name
                streamed.ids[call.index] = call.id
            assert call.index in streamed.names, "arguments never come before the name"
            streamed.arguments[call.index] = streamed.arguments.get(call.index, "") + call.arguments
    return streamed


@pytest.fixture(params=[None, 1, 3, 7], ids=["whole", "by1", "by3", "by7"])
def piece(request: pytest.FixtureRequest) -> int | None:
    """Every test runs with the text whole and cut in pieces of several sizes."""
    return request.param


def check_consistent(parser: ToolParser, streamed: Streamed) -> None:
    """For well-formed output, what streamed is exactly the final message."""
    assert streamed.content == (parser.content or "")
    assert [streamed.names[i] for i in sorted(streamed.names)] == [c.name for c in parser.calls]
    assert [streamed.arguments.get(i, "") for i in sorted(streamed.names)] == [
        c.arguments for c in parser.calls
    ]
    assert [streamed.ids[i] for i in sorted(streamed.ids)] == [c.id for c in parser.calls]
