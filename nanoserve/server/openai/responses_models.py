"""The Responses API's request body (POST /v1/responses), as pydantic models.

Responses and stream events are plain dicts built in `response_output.py`, in the shapes of
OpenAI's Responses API (the openai SDK reads them into its own types).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from nanoserve.server.openai.api_models import (
    OpenAIModel,
    validate_num_messages,
    validate_num_tools,
)


class InputContent(OpenAIModel):
    """A part of an input message: `input_text` (or `output_text` in an assistant turn)."""

    type: str
    text: str | None = None


class InputItem(OpenAIModel):
    """One input item: a message, a function call the model made, or a call's output."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None


class FunctionTool(OpenAIModel):
    """A function tool; the Responses API writes it flat (no `function` wrapper)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(OpenAIModel):
    """`text.format`: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    metadata: dict[str, Any] | None = None  # bounded by checks.check_metadata
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _num_items(cls, value: object) -> object:
        return validate_num_messages(value, "input")

    @field_validator("tools", mode="before")
    @classmethod
    def _num_tools(cls, value: object) -> object:
        return validate_num_tools(value)
