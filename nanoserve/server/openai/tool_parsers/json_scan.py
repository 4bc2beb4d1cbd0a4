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
    """One `{"name": "...", "arguments": {...}}` object, fed in pieces (`feed`).

    Each character is read once and the pieces are kept as they came (joined only when the
    whole text is asked for), so a call of any length costs time in proportion to its length.
    """

    def __init__(self) -> None:
        self.num_chars = 0  # read so far
        self.spans: dict[str, list[int]] = {}  # key -> [start, end) of its raw value; end -1: open
        self.is_done = False  # the closing brace has been read
        self.is_malformed = False  # not a JSON object of this shape
        self._pieces: list[str] = []  # the text read, as fed
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "start"  # start | key | colon | value | in_value | comma
        self._key = ""
        self._top_string: list[str] = []  # the top-level string being read, its quotes too
        self._strings: dict[str, str] = {}  # key -> its top-level string value's raw text

    def feed(self, text: str) -> int:
        """Read `text`; returns how many characters belonged to the object (it may end early)."""
        consumed = len(text)
        for offset, char in enumerate(text):
            if self.is_done or self.is_malformed:
                consumed = offset
                break
            self._read(char, self.num_chars + offset)
        if consumed:
            self._pieces.append(text[:consumed])
            self.num_chars += consumed
        return consumed

    @property
    def text(self) -> str:
        """Everything read so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def name(self) -> str | None:
        """The call's name once its string is complete."""
        raw = self._strings.get("name")
        if raw is None or self.spans["name"][1] == -1:
            return None
        value = _loads_or_none(raw)
        return value if isinstance(value, str) else None

    def arguments_text(self, since: int = 0) -> str:
        """The raw text of the arguments read so far ("" before they start), from character
        `since` of them on: the text of the last piece fed is sliced alone."""
        for key in ARGUMENT_KEYS:
            if key in self.spans:
                start, end = self.spans[key]
                return self._chars(start + since, self.num_chars if end == -1 else end)
        return ""

    def parsed(self) -> tuple[str, str] | None:
        """(name, raw arguments) of a finished, well-formed call; None otherwise."""
        if not self.is_done or self.is_malformed:
            return None
        call = _loads_or_none(self.text)
        if not isinstance(call, dict):
            return None
        arguments = next((call[k] for k in ARGUMENT_KEYS if k in call), None)
        if not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return None
        return call["name"], self.arguments_text()

    def _chars(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        last = self._pieces[-1] if self._pieces else ""
        last_start = self.num_chars - len(last)
        if start >= last_start:
            return last[start - last_start : end - last_start]
        return self.text[start:end]

    def _read(self, char: str, i: int) -> None:
        if self._in_string:
            if self._depth == 1:
                self._top_string.append(char)
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
        self._top_string = ['"']
        if self._expect == "value":
            self._open_value(i)
        elif self._expect != "key":
            self.is_malformed = True

    def _end_top_level_string(self, i: int) -> None:
        raw = "".join(self._top_string)
        if self._expect == "key":
            key = _loads_or_none(raw)  # None: an invalid escape
            self.is_malformed = key is None
            self._key = key or ""
            self._expect = "colon"
        elif self._expect == "in_value":
            self._strings[self._key] = raw
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
        self._strings.pop(self._key, None)  # a repeated key: its last value counts
        self._expect = "in_value"

    def _close_value(self, end: int) -> None:
        self.spans[self._key][1] = end
        self._expect = "comma"


def _loads_or_none(text: str) -> Any:
    """The JSON value of `text` (no deeper than MAX_JSON_DEPTH: the scanner saw to it); None
    if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None
