"""CallScanner: reads one JSON tool-call object as it streams in, character by character.

It finds the top-level keys and the raw text span of each value, so that a parser can stream
a call's name as soon as it is complete and its arguments as their raw text arrives, with no
re-serialisation: the arguments a client receives are exactly what the model wrote, streamed
or not. The finished object is checked with `json.loads`; anything else is malformed, and so is
an object that nests deeper than MAX_JSON_DEPTH (what a request body may): the scanner counts
its depth as it reads, so `json.loads` (recursive) never sees more than that.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.server.json_depth import MAX_JSON_DEPTH

ARGUMENT_KEYS = ("arguments", "parameters")


class CallScanner:
    """One `{"name": "...", "arguments": {...}}` object, fed in pieces (`feed`)."""

    def __init__(self) -> None:
        self.text = ""
        self.spans: dict[str, list[int]] = {}  # key -> [start, end) of its raw value; end -1: open
        self.is_done = False  # the closing brace has been read
        self.is_malformed = False  # not a JSON object of this shape
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "start"  # start | key | colon | value | in_value | comma
        self._key_start = 0
        self._key = ""

    def feed(self, text: str) -> int:
        """Read `text`; returns how many characters belonged to the object (it may end early)."""
        for offset, char in enumerate(text):
            if self.is_done or self.is_malformed:
                return offset
            self.text += char
            self._read(char, len(self.text) - 1)
        return len(text)

    @property
    def name(self) -> str | None:
        """The call's name once its string is complete."""
        value = self._value("name")
        return value if isinstance(value, str) else None

    def arguments_text(self) -> str:
        """The raw text of the arguments read so far ("" before they start)."""
        for key in ARGUMENT_KEYS:
            if key in self.spans:
                start, end = self.spans[key]
                return self.text[start:] if end == -1 else self.text[start:end]
        return ""

    def parsed(self) -> tuple[str, str] | None:
        """(name, raw arguments) of a finished, well-formed call; None otherwise."""
        if not self.is_done or self.is_malformed:
            return None
        try:
            call = json.loads(self.text)
        except ValueError:
            return None
        arguments = next((call[k] for k in ARGUMENT_KEYS if k in call), None)
        if not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return None
        return call["name"], self.arguments_text()

    def _value(self, key: str) -> Any:
        span = self.spans.get(key)
        if span is None or span[1] == -1:
            return None
        try:
            return json.loads(self.text[span[0] : span[1]])
        except ValueError:
            return None

    def _read(self, char: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._end_top_level_string(i)
        elif self._expect == "start":
            self._depth, self._expect = 1, "key"
            self.is_malformed = char != "{"
        elif char == '"':
            self._in_string = True
            if self._depth == 1:
                self._start_top_level_string(i)
        elif self._depth == 1:
            self._read_top_level(char, i)
        elif char in "{[":
            self._open_bracket()
        elif char in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._close_value(i + 1)

    def _start_top_level_string(self, i: int) -> None:
        if self._expect == "key":
            self._key_start = i
        elif self._expect == "value":
            self._open_value(i)
        else:
            self.is_malformed = True

    def _end_top_level_string(self, i: int) -> None:
        if self._expect == "key":
            self._key = json.loads(self.text[self._key_start : i + 1])
            self._expect = "colon"
        elif self._expect == "in_value":
            self._close_value(i + 1)

    def _read_top_level(self, char: str, i: int) -> None:
        """A character outside strings, directly inside the object."""
        expect = self._expect
        if expect == "in_value" and (char.isspace() or char in ",}"):
            self._close_value(i)  # the end of a number, true, false or null
            expect = self._expect
        if char.isspace() or expect == "in_value":
            return
        if expect == "colon" and char == ":":
            self._expect = "value"
        elif expect == "value":
            self._open_value(i)
            if char in "{[":
                self._open_bracket()
        elif expect == "comma" and char == ",":
            self._expect = "key"
        elif char == "}" and (expect == "comma" or (expect == "key" and not self.spans)):
            self._depth, self.is_done = 0, True
        else:
            self.is_malformed = True

    def _open_bracket(self) -> None:
        self._depth += 1
        if self._depth > MAX_JSON_DEPTH:
            self.is_malformed = True

    def _open_value(self, start: int) -> None:
        self.spans[self._key] = [start, -1]
        self._expect = "in_value"

    def _close_value(self, end: int) -> None:
        self.spans[self._key][1] = end
        self._expect = "comma"
