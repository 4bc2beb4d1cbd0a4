"""`tools` and `tool_choice` on chat completions, as vLLM serves them.

`plan_tools` decides three things for a request: which tools the chat template shows the model
(the checkpoint's template decides the format), whether structured output forces a call, and
which parser reads calls out of each choice's text:

- `none`: the template shows the tools; the output is plain text.
- `auto` (the default with tools): the output is read by `--tool-call-parser`, which
  `--enable-auto-tool-choice` must switch on (a 400 otherwise, as in vLLM).
- `required`: a grammar makes the output a JSON array of `{"name", "parameters"}` calls to
  declared tools (forced.RequiredToolCallParser reads it).
- `{"type": "function", "function": {"name": ...}}`: a grammar makes the output that
  function's arguments (forced.NamedToolCallParser).

The template shows the tools in every case, so the prompt is the same whatever the choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoserve.common.sampling_params import StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.json_depth import loads_bounded
from nanoserve.server.openai.api_models import ChatCompletionRequest, ChatTool
from nanoserve.server.openai.constraint_limits import MAX_ALTERNATIVES
from nanoserve.server.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolParser,
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: the template's tools, a forcing grammar, a parser."""

    template_tools: list[dict[str, Any]] | None = None
    constraint: StructuredOutputsParams | None = None
    make_parser: Callable[[], ToolParser] | None = None
    needs_special_tokens: bool = False


def plan_tools(
    request: ChatCompletionRequest, tool_call_parser: str | None, enable_auto_tool_choice: bool
) -> ToolPlan:
    """The request's ToolPlan; APIError (400) for a tool_choice the server cannot honour."""
    tools, choice = request.tools or [], request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools: declare them in `tools`", 400, "tool_choice")
        return ToolPlan()
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(template_tools)
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                400,
                "tool_choice",
            )
        parser_class = TOOL_PARSERS[tool_call_parser]
        return ToolPlan(
            template_tools,
            make_parser=parser_class,
            needs_special_tokens=parser_class.needs_special_tokens,
        )
    if choice == "required":
        if len(tools) > MAX_ALTERNATIVES:  # each tool is one branch of the forcing grammar
            raise APIError(
                f'tool_choice "required" chooses among at most {MAX_ALTERNATIVES} tools, got '
                f"{len(tools)}",
                400,
                "tools",
            )
        schema = required_calls_schema(tools, request.parallel_tool_calls)
        return ToolPlan(
            template_tools, StructuredOutputsParams(json=schema), RequiredToolCallParser
        )
    tool = _named_tool(tools, choice)
    constraint = StructuredOutputsParams(json=tool.function.parameters or EMPTY_PARAMETERS)
    name = tool.function.name
    return ToolPlan(template_tools, constraint, lambda: NamedToolCallParser(name))


def _named_tool(tools: list[ChatTool], choice: Any) -> ChatTool:
    if isinstance(choice, str):
        raise APIError(
            f"tool_choice must be none, auto, required or a function, got {choice!r}",
            400,
            "tool_choice",
        )
    by_name = {tool.function.name: tool for tool in tools}
    if choice.function.name not in by_name:
        raise APIError(
            f"tool_choice names function {choice.function.name!r}, which is not in tools "
            f"({', '.join(by_name)})",
            400,
            "tool_choice",
        )
    return by_name[choice.function.name]


def required_calls_schema(tools: list[ChatTool], parallel_tool_calls: bool | None) -> dict:
    """A JSON array of one or more calls, each a declared tool's name and its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or EMPTY_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def templated_tool_calls(tool_calls: Any) -> Any:
    """An assistant message's tool calls for the template: JSON-string arguments as objects.

    OpenAI clients send `arguments` as a JSON string; chat templates expect a mapping (they
    `tojson` it), so a string would be quoted twice. Arguments that are not a JSON object, or
    nest deeper than MAX_JSON_DEPTH, stay as they are.
    """
    if not isinstance(tool_calls, list):
        return tool_calls
    converted = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = loads_bounded(function["arguments"])
            except ValueError:  # not JSON, or nested deeper than a request body may
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        converted.append(call)
    return converted
