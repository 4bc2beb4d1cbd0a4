"""Tool calls that structured output forced, whatever the model's own format (as vLLM does).

- `tool_choice: "required"`: the grammar makes the output a JSON array of
  `{"name": <a declared tool>, "parameters": {...}}` objects.
- a named `tool_choice`: the grammar makes the output that function's arguments object.
"""

from __future__ import annotations

import json

from nanoserve.server.openai.tool_parsers.base import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)
from nanoserve.server.openai.tool_parsers.mistral import JsonArrayCalls


class RequiredToolCallParser(JsonArrayCalls):
    """The output is a JSON array of calls."""

    def __init__(self) -> None:
        super().__init__("open")


class NamedToolCallParser(ToolParser):
    """The output is the arguments of one function: its name is known before any text."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._id = new_tool_call_id()
        self._arguments = ""
        self._is_name_sent = False

    def feed(self, text: str) -> ParsedDelta:
        delta = ParsedDelta()
        if not self._is_name_sent:
            self._is_name_sent = True
            delta.tool_calls.append(ToolCallDelta(0, self._id, self._name))
        if text:
            self._arguments += text
            if len(delta.tool_calls) == 1:
                delta.tool_calls[0].arguments = text
            else:
                delta.tool_calls.append(ToolCallDelta(0, arguments=text))
        return delta

    def finish(self) -> ParsedDelta:
        try:
            is_object = isinstance(json.loads(self._arguments), dict)
        except ValueError:
            is_object = False
        if is_object:
            self.calls.append(ToolCall(self._name, self._arguments, self._id))
        else:  # cut off (max_tokens): text, as any malformed call
            self._content_parts.append(self._arguments)
        return ParsedDelta()
