"""The OpenAI-compatible API's request and response bodies, as pydantic models.

Unknown request fields are ignored (clients send many). Numbers must be finite (`"inf"` and
`"nan"` strings are refused too). Ranges are checked by `SamplingParams`, so that the server
and the offline `LLM` give the same messages.
"""

from __future__ import annotations

import reprlib
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    StrictInt,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

TokenIds = list[StrictInt]
Prompt = str | list[str] | TokenIds | list[TokenIds]
# OpenAI's limit on the inputs of one request; --max-waiting-requests may allow fewer.
MAX_PROMPTS = 2048
# Messages and their content parts in one conversation (chat, /tokenize, a Responses input),
# and tools in one request, counted before pydantic reads them one by one: reading a million
# empty messages would hold the event loop for seconds, and the chat template would render each.
MAX_MESSAGES = 10_000
MAX_TOOLS = 10_000  # tool_choice "required" chooses among fewer (constraint_limits)
# Entries of stop_token_ids and logit_bias, counted before pydantic reads them (then they are
# deduplicated, sorted and checked on the event loop): more than any vocabulary has ids.
MAX_TOKEN_ID_ENTRIES = 1 << 18
_TEXTS: TypeAdapter[list[str]] = TypeAdapter(list[str])
_TOKEN_IDS: TypeAdapter[list[int]] = TypeAdapter(TokenIds)
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class OpenAIModel(BaseModel):
    """Base of every request body: unknown fields are accepted and dropped."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    """`stream_options`: end a stream with a usage chunk; with it, usage on every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs`: one of a JSON schema, regex, choice list or grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: a named schema; `strict` is always honoured."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """`response_format`: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Sampling and stopping fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of every prompt token (no streaming)
    # Structured output: vLLM's field, its older guided_* names, and OpenAI's response_format.
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None

    @field_validator("stop_token_ids", "logit_bias", mode="before")
    @classmethod
    def _num_token_ids(cls, value: object, info: ValidationInfo) -> object:
        return validate_num_token_id_entries(value, str(info.field_name))


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Prompt
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt", mode="plain", json_schema_input_type=Prompt)
    @classmethod
    def _prompt_shape(cls, value: object) -> Prompt:
        return validate_prompt(value)


def validate_prompt(value: object) -> Prompt:
    """A prompt in one of its four shapes, chosen by its first element.

    pydantic's union would try every shape against every element (millions of errors for a
    long list of token ids); here each element is checked once, against the one shape.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"prompt must be {_PROMPT_SHAPES}")
    if not value:
        return value
    first = value[0]
    if not isinstance(first, (str, list)):
        return _checked(_TOKEN_IDS, value, "prompt", "a token id (an integer)")
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"a request takes at most {MAX_PROMPTS} prompts, got {len(value)}")
    if isinstance(first, str):
        return _checked(_TEXTS, value, "prompt", "a string like prompt[0]")
    prompts = []
    for index, item in enumerate(value):
        if not isinstance(item, list):
            raise ValueError(f"prompt[{index}] must be a list of token ids like prompt[0]")
        prompts.append(_checked(_TOKEN_IDS, item, f"prompt[{index}]", "a token id (an integer)"))
    return prompts


def validate_num_messages(value: object, name: str) -> object:
    """`value` unchanged, unless it is a list of more than MAX_MESSAGES messages and content
    parts (`content` or a Responses item's `output` as a list) together."""
    if not isinstance(value, list):
        return value
    num_items = len(value)
    for message in value[: MAX_MESSAGES + 1]:
        if isinstance(message, dict):
            num_items += sum(
                len(parts)
                for key in ("content", "output")
                if isinstance(parts := message.get(key), list)
            )
    if num_items > MAX_MESSAGES:
        raise ValueError(
            f"{name} takes at most {MAX_MESSAGES} messages and content parts together, got "
            f"{len(value)} messages and {num_items - len(value)} parts"
        )
    return value


def validate_num_token_id_entries(value: object, name: str) -> object:
    """`value` unchanged, unless it is a list or object of more than MAX_TOKEN_ID_ENTRIES."""
    if isinstance(value, (list, dict)) and len(value) > MAX_TOKEN_ID_ENTRIES:
        raise ValueError(f"{name} takes at most {MAX_TOKEN_ID_ENTRIES} token ids, got {len(value)}")
    return value


def validate_num_tools(value: object) -> object:
    """`value` unchanged, unless it is a list of more than MAX_TOOLS tools."""
    if isinstance(value, list) and len(value) > MAX_TOOLS:
        raise ValueError(f"tools takes at most {MAX_TOOLS} tools, got {len(value)}")
    return value


def _checked(adapter: TypeAdapter, value: list, name: str, expected: str) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        error = e.errors()[0]
        where = "".join(f"[{part}]" for part in error["loc"])
        got = reprlib.repr(error["input"])
        raise ValueError(f"{name}{where} must be {expected}, got {got}") from None


class ContentPart(OpenAIModel):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served."""

    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    """One chat message. Extra keys (name, tool_calls, ...) reach the template unchanged."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class FunctionDefinition(OpenAIModel):
    """A function the model may call: its name, what it does, a JSON schema of its arguments."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """`tool_choice` naming one function: `{"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # template text; only with --trust-request-chat-template
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _num_messages(cls, value: object) -> object:
        return validate_num_messages(value, "messages")

    @field_validator("tools", mode="before")
    @classmethod
    def _num_tools(cls, value: object) -> object:
        return validate_num_tools(value)


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # template text; only with --trust-request-chat-template

    @field_validator("messages", mode="before")
    @classmethod
    def _num_messages(cls, value: object) -> object:
        return validate_num_messages(value, "messages")


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: TokenIds


# ---- responses ----


class UsageInfo(BaseModel):
    """Token counts of one request (all its choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's logprob of one token at one prompt position, its rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: token id -> its entry (the prompt token and the top ones); None for the first.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    """One choice of a stream chunk (and the base of a whole completion's choice)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponseChoice(CompletionChoice):
    """One choice of a whole completion."""

    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (`object` differs only in name)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[SerializeAsAny[CompletionChoice]]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The chosen token at a position and its `top_logprobs` alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    """The function a tool call calls; `arguments` is a JSON object's text."""

    name: str
    arguments: str


class ChatToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant's reply: text, tool calls, or both."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a chat stream chunk; `delta` holds only what is new."""

    index: int
    delta: dict[str, Any]  # role, content, tool_calls: only what is new
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanoserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
