"""Llama 3.1 / 3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `;`.

The output is tool calls only if it starts (after `<|python_tag|>`, when special tokens are
kept, and whitespace) with `{`; otherwise all of it is content, as in vLLM's llama3_json.
"""

from __future__ import annotations

from nanoserve.server.openai.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Bare JSON call objects at the start of the output, separated by semicolons."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start | text | between | call

    def _consume(self, final: bool) -> None:
        while self._buffer:
            if self._state == "text":
                self._emit_content(self._buffer)
                self._buffer = ""
            elif self._state == "start" and not self._read_start(final):
                return
            elif self._state == "between":
                self._read_between()
            elif self._state == "call":
                if not self._feed_open_call():
                    return
                assert self._open is not None
                self._state = "between" if self._open.scanner.is_done else "text"
                if not self._close_call():
                    self._state = "text"

    def _read_start(self, final: bool) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(PYTHON_TAG):
            self._buffer = stripped[len(PYTHON_TAG) :]
            self._state = "between"
        elif stripped.startswith("{"):
            self._buffer = stripped
            self._state = "between"
        elif not final and PYTHON_TAG.startswith(stripped):
            return False  # only whitespace, or a piece of the tag, so far
        else:
            self._state = "text"
        return True

    def _read_between(self) -> None:
        stripped = self._buffer.lstrip()
        self._buffer = stripped
        if stripped.startswith(";"):
            self._buffer = stripped[1:]
        elif stripped.startswith("{"):
            self._open_call("")
            self._state = "call"
        elif stripped:
            self._state = "text"
