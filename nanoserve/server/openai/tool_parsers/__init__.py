"""Tool-call parsers: each model family's format → `tool_calls`, streaming and not.

`--tool-call-parser` picks one of TOOL_PARSERS for `tool_choice: "auto"`; `required` and a
named tool choice are forced by structured output and read by the parsers in forced.py.
"""

from __future__ import annotations

from nanoserve.server.openai.tool_parsers.base import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from nanoserve.server.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallParser
from nanoserve.server.openai.tool_parsers.hermes import HermesToolParser
from nanoserve.server.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from nanoserve.server.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "NamedToolCallParser",
    "ParsedDelta",
    "RequiredToolCallParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
]
