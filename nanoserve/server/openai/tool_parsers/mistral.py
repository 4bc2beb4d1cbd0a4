"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content.

`[TOOL_CALLS]` is a special token in Mistral's tokenizers, so the output is detokenized with
special tokens kept when this parser is on. `JsonArrayCalls` (a JSON array of call objects) is
shared with the forced `required` tool choice.
"""

from __future__ import annotations

from nanoserve.server.openai.tool_parsers.base import ToolParser

TOOL_CALLS = "[TOOL_CALLS]"


class JsonArrayCalls(ToolParser):
    """Reads `[call, call, ...]`; what breaks the array's shape, and what follows it, is text."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self._state = state  # text | open (expect "[") | item | call | separator
        self._array_text = ""  # punctuation read since the last call: content if it breaks

    def _consume(self, final: bool) -> None:
        while self._buffer or (final and self._state == "text"):
            if self._state == "text":
                if not self._read_text(final):
                    return
            elif self._state == "call":
                if not self._feed_open_call():
                    return
                self._state = "separator" if self._close_call() else "text"
            elif not self._read_punctuation():
                return

    def _read_text(self, final: bool) -> bool:
        self._emit_content(self._buffer)
        self._buffer = ""
        return False

    def _read_punctuation(self) -> bool:
        """`[` to open, `{` to start a call, `,` between calls, `]` to close; False: wait."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False  # whitespace so far: kept, it belongs to what comes next
        char, state = stripped[0], self._state
        if state == "open" and char == "[":
            self._state = "item"
        elif state == "item" and char == "{":
            self._open_call(self._array_text + self._buffer[: len(self._buffer) - len(stripped)])
            self._array_text = ""
            self._state = "call"
            self._buffer = stripped
            return True
        elif state == "separator" and char == ",":
            self._state = "item"
        elif state in ("item", "separator") and char == "]":
            self._state = self._after_array()
        else:
            self._state = "text"  # not a call array after all
            self._emit_content(self._array_text)
            self._array_text, self._buffer = "", stripped
            return True
        self._array_text += self._buffer[: len(self._buffer) - len(stripped) + 1]
        self._buffer = stripped[1:]
        return True

    def _after_array(self) -> str:
        return "text"


class MistralToolParser(JsonArrayCalls):
    """Content, then `[TOOL_CALLS]` and a JSON array of calls."""

    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__("text")

    def _read_text(self, final: bool) -> bool:
        if not self._emit_text_until(TOOL_CALLS, final):
            return False
        self._state, self._array_text = "open", TOOL_CALLS
        return True
