"""ToolParser: splits one choice's output into content and tool calls, as the text streams in.

Each model family writes tool calls in its own format (hermes.py, llama3_json.py,
mistral.py; forced.py for calls that structured output forced). A parser is fed the choice's
new text (`feed`) and told when it ends (`finish`); each call returns a `ParsedDelta`: the
content that is safe to show and the tool-call pieces to stream (a call's id and name first,
then its arguments' raw text as it arrives, as vLLM streams them). When the output ends,
`content` and `calls` are the whole message.

A call that is not well formed (bad JSON, no name, arguments that are not an object, cut off,
nested deeper than MAX_JSON_DEPTH) stays content text, never an error (forced calls are
dropped instead: forced.py). The one case the stream cannot take back: a call whose name was
already streamed and which then breaks; the final message has it as text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from nanoserve.server.openai.tool_parsers.json_scan import CallScanner


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One finished call: `arguments` is the JSON object's text exactly as the model wrote it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its id and name come once, first; arguments text after."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one `feed` or `finish` added: content to show and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class _OpenCall:
    """A call being read: its scanner, the raw text it began with, what has been streamed."""

    index: int
    scanner: CallScanner
    opening: str  # e.g. "<tool_call>\n": text that becomes content again if the call breaks
    id: str = field(default_factory=new_tool_call_id)
    is_name_sent: bool = False
    num_argument_chars_sent: int = 0


class ToolParser:
    """Base of the family parsers: the content and call bookkeeping they share."""

    needs_special_tokens = False  # the format uses special tokens the text must keep

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._content_parts: list[str] = []
        self._held_whitespace = ""  # trailing whitespace: dropped if a call follows
        self._is_after_call = False
        self._buffer = ""  # text not yet consumed
        self._open: _OpenCall | None = None
        self._num_calls_started = 0
        self._delta = ParsedDelta()

    @property
    def content(self) -> str | None:
        """The message's content once the output is over (None when there is none)."""
        return "".join(self._content_parts) or None

    def feed(self, text: str) -> ParsedDelta:
        self._delta = ParsedDelta()
        self._buffer += text
        self._consume(final=False)
        return self._delta

    def finish(self) -> ParsedDelta:
        self._delta = ParsedDelta()
        self._consume(final=True)
        if self._open is not None:  # cut off inside a call
            self._abandon_call(self._open.scanner.text + self._buffer)
            self._buffer = ""
        if self._buffer:
            self._emit_content(self._buffer)
            self._buffer = ""
        if not self._is_after_call:
            self._append_content(self._held_whitespace)
        self._held_whitespace = ""
        return self._delta

    def _consume(self, final: bool) -> None:
        """Consume `self._buffer` as far as the format allows (the family's state machine)."""
        raise NotImplementedError

    def _emit_text_until(self, tag: str, final: bool) -> bool:
        """Content up to `tag`, which is consumed: True; False if it has not appeared (yet)."""
        start = self._buffer.find(tag)
        if start == -1:
            keep = 0 if final else partial_tag_length(self._buffer, tag)
            self._emit_content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._emit_content(self._buffer[:start])
        self._buffer = self._buffer[start + len(tag) :]
        return True

    # -- content --------------------------------------------------------------------------

    def _emit_content(self, text: str) -> None:
        """Content text; whitespace next to a call is dropped, so `content` has none."""
        text = self._held_whitespace + text
        if self._is_after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._held_whitespace = text[len(body) :]
        if body:
            self._is_after_call = False
            self._append_content(body)

    def _append_content(self, text: str) -> None:
        if text:
            self._content_parts.append(text)
            self._delta.content += text

    # -- calls ----------------------------------------------------------------------------

    def _open_call(self, opening: str) -> None:
        self._held_whitespace = ""
        self._open = _OpenCall(self._num_calls_started, CallScanner(), opening)
        self._num_calls_started += 1

    def _feed_open_call(self) -> bool:
        """Feed the buffer to the open call; True once it is finished (well formed or not)."""
        call = self._open
        assert call is not None
        if not call.scanner.num_chars:
            stripped = self._buffer.lstrip()
            call.opening += self._buffer[: len(self._buffer) - len(stripped)]
            self._buffer = stripped
            if not stripped:
                return False
        consumed = call.scanner.feed(self._buffer)
        self._buffer = self._buffer[consumed:]
        self._stream(call)
        return call.scanner.is_done or call.scanner.is_malformed

    def _stream(self, call: _OpenCall) -> None:
        name = call.scanner.name
        if not call.is_name_sent and name is not None:
            call.is_name_sent = True
            self._delta.tool_calls.append(ToolCallDelta(call.index, call.id, name))
        if not call.is_name_sent:
            return
        new = call.scanner.arguments_text(since=call.num_argument_chars_sent)
        if new:
            call.num_argument_chars_sent += len(new)
            last = self._delta.tool_calls[-1] if self._delta.tool_calls else None
            if last is not None and last.index == call.index:
                last.arguments += new
            else:
                self._delta.tool_calls.append(ToolCallDelta(call.index, arguments=new))

    def _close_call(self, closing: str = "") -> bool:
        """End the open call: a ToolCall if well formed (True), else its text as content."""
        call = self._open
        assert call is not None
        self._open = None
        parsed = call.scanner.parsed()
        if parsed is None:
            self._abandon_call(call.scanner.text + closing, call)
            return False
        self.calls.append(ToolCall(parsed[0], parsed[1], call.id))
        self._is_after_call = True
        return True

    def _abandon_call(self, text: str, call: _OpenCall | None = None) -> None:
        call = call or self._open
        self._open = None
        assert call is not None
        self._emit_content(call.opening + text)


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (held back)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
