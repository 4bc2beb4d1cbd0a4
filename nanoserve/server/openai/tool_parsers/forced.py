"""Tool calls that structured output forced, whatever the model's own format (as vLLM does).

- `tool_choice: "required"`: the grammar makes the output a JSON array of
  `{"name": <a declared tool>, "parameters": {...}}` objects.
- a named `tool_choice`: the grammar makes the output that function's arguments object.

The grammar lets the model write nothing but calls, so what is not a complete call here is a
call cut short (by max_tokens: the finish reason says `length`) or one nested deeper than
MAX_JSON_DEPTH; it is dropped, never content. The message holds the complete calls; a stream
has already shown the start of the broken one, as any parser's stream would.
"""

from __future__ import annotations

from nanoserve.server.json_depth import loads_bounded
from nanoserve.server.openai.tool_parsers.base import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)
from nanoserve.server.openai.tool_parsers.mistral import JsonArrayCalls


class RequiredToolCallParser(JsonArrayCalls):
    """The output is a JSON array of calls; only the complete ones count."""

    def __init__(self) -> None:
        super().__init__("open")

    def _append_content(self, text: str) -> None:
        """Nothing is content: text outside the calls is a broken call's, dropped."""


class NamedToolCallParser(ToolParser):
    """The output is the arguments of one function: its name is known before any text."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._id = new_tool_call_id()
        self._argument_pieces: list[str] = []  # joined once, at the end
        self._is_name_sent = False

    def feed(self, text: str) -> ParsedDelta:
        delta = ParsedDelta()
        if not self._is_name_sent:
            self._is_name_sent = True
            delta.tool_calls.append(ToolCallDelta(0, self._id, self._name))
        if text:
            self._argument_pieces.append(text)
            if len(delta.tool_calls) == 1:
                delta.tool_calls[0].arguments = text
            else:
                delta.tool_calls.append(ToolCallDelta(0, arguments=text))
        return delta

    def finish(self) -> ParsedDelta:
        arguments = "".join(self._argument_pieces)
        try:
            is_object = isinstance(loads_bounded(arguments), dict)
        except ValueError:  # cut short, or nested too deeply: dropped
            is_object = False
        if is_object:
            self.calls.append(ToolCall(self._name, arguments, self._id))
        return ParsedDelta()
