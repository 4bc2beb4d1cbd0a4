"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Any text around the calls is content. The closing tag may be missing at the very end (the
model stopped right after the object), as vLLM accepts.
"""

from __future__ import annotations

from nanoserve.server.openai.tool_parsers.base import ToolParser

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """Calls framed by `<tool_call>` and `</tool_call>`, one JSON object each."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # text | call | after_call

    def _consume(self, final: bool) -> None:
        while True:
            if self._state == "text":
                if not self._emit_text_until(START, final):
                    return
                self._open_call(START)
                self._state = "call"
            elif self._state == "call":
                if not self._feed_open_call():
                    return
                assert self._open is not None
                if self._open.scanner.is_malformed:
                    self._close_call()  # its text so far is content; the rest follows as text
                    self._state = "text"
                else:
                    self._state = "after_call"
            elif not self._read_end_tag(final):
                return

    def _read_end_tag(self, final: bool) -> bool:
        """After a call's object: its closing tag, or anything else; False to wait for more."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(END):
            self._buffer = stripped[len(END) :]
            self._close_call(END)
        elif not final and END.startswith(stripped):
            return False  # whitespace or a piece of the closing tag so far
        else:
            self._close_call()
        self._state = "text"
        return True
