"""POST /v1/chat/completions: messages through the chat template in, an assistant message out.

One request, top to bottom: the route reads the body; `start_chat` checks it, plans its tools,
renders and tokenizes the prompt, builds its sampling params and starts the run; then the run is
answered as a stream of `chat.completion.chunk`s (`chat_chunks`) or one `chat.completion`
(`chat_completion`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.server.errors import APIError
from nanoserve.server.openai.api_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatToolCall,
    FunctionCall,
    TopLogprob,
)
from nanoserve.server.openai.chat_prompt import chat_prompt
from nanoserve.server.openai.chat_tools import ToolPlan, plan_tools
from nanoserve.server.openai.checks import check_capacity, check_model
from nanoserve.server.openai.constraints import Constraint, request_constraint
from nanoserve.server.openai.logprobs import vllm_prompt_logprobs
from nanoserve.server.openai.request_run import (
    RequestRun,
    start_run,
    stream_answer,
    stream_usage,
    whole_answer,
)
from nanoserve.server.openai.sampling import fit_logprobs_bound, max_tokens_for, sampling_params
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.openai.tool_parsers import ParsedDelta, ToolParser
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.text.output_processor import ChoiceState, ChoiceUpdate, PositionLogprobs


def router(model: ServedModel) -> APIRouter:
    """The chat completions route, serving `model`."""
    routes = APIRouter()

    @routes.post("/v1/chat/completions", openapi_extra=json_body_schema(ChatCompletionRequest))
    async def create_chat_completion(request: Request) -> Response:
        body = await read_json_body(request, ChatCompletionRequest, model.config)
        run, tools = await start_chat(model, body, request)
        if body.stream:
            return stream_answer(run, chat_chunks(model, body, run, tools))
        return await whole_answer(request, run, chat_completion(model, body, run, tools))

    return routes


async def start_chat(
    model: ServedModel, body: ChatCompletionRequest, request: Request
) -> tuple[RequestRun, ToolPlan]:
    """Checks, tools, prompt, sampling params, then the run: a chat request up to the engine."""
    check_model(model, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
    check_capacity(model, body.n, "n")  # before the template renders anything
    config = model.config
    tools = plan_tools(body, config.tool_call_parser, config.enable_auto_tool_choice)
    constraint = request_constraint(body, tools.constraint)  # bounded before the template runs
    prompt = await chat_prompt(model, body, tools.template_tools)
    params = _sampling_params(model, body, len(prompt), tools, constraint)
    run = await start_run(model, request, [prompt], [params], "chatcmpl", constraint)
    return run, tools


def _sampling_params(
    model: ServedModel,
    body: ChatCompletionRequest,
    num_prompt: int,
    tools: ToolPlan,
    constraint: Constraint | None,
) -> SamplingParams:
    """max_completion_tokens (or the older max_tokens), logprobs and the constraint."""
    param, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is None:
        param, max_tokens = "max_tokens", body.max_tokens
    max_tokens = max_tokens_for(model, num_prompt, max_tokens, param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    structured = constraint.params if constraint is not None else None
    params = sampling_params(model, body, max_tokens, logprobs, body.prompt_logprobs, structured)
    if body.max_completion_tokens is None and body.max_tokens is None:
        params = fit_logprobs_bound(params, num_prompt)
    if tools.needs_special_tokens:  # the parser reads the model's tool-call tokens
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


async def chat_completion(
    model: ServedModel, body: ChatCompletionRequest, run: RequestRun, tools: ToolPlan
) -> ChatCompletionResponse:
    """The whole chat completion, once every choice has finished."""
    await run.finish()
    choices = []
    for choice in run.choices:
        message, finish_reason = ChatResponseMessage(content=choice.text), choice.finish_reason
        if tools.make_parser is not None:
            message, finish_reason = _tool_message(tools.make_parser(), choice)
        choices.append(
            ChatChoice(
                index=choice.index,
                message=message,
                logprobs=_logprobs(choice.logprobs) if body.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=choice.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=run.request_id,
        model=model.name,
        choices=choices,
        usage=run.usage(),
        prompt_logprobs=vllm_prompt_logprobs(run.choices[0]),
    )


async def chat_chunks(
    model: ServedModel, body: ChatCompletionRequest, run: RequestRun, tools: ToolPlan
) -> AsyncIterator[ChatCompletionChunk]:
    """The stream: a role chunk, a chunk per burst of updates, and usage if asked for."""
    created = int(time.time())
    include_usage, continuous_usage = stream_usage(body.stream_options)

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=run.request_id,
            created=created,
            model=model.name,
            choices=choices,
            usage=run.usage() if continuous_usage else None,
        )

    yield chunk(
        [
            ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""})
            for c in run.choices
        ]
    )
    make_parser = tools.make_parser
    parsers = {c.index: make_parser() for c in run.choices} if make_parser else {}
    async for updates in run.updates():
        choices = [_chunk_choice(body, u, parsers.get(u.choice.index)) for u in updates]
        if any(c is not None for c in choices):
            yield chunk([c for c in choices if c is not None])
    if include_usage:
        final = chunk([])
        final.usage = run.usage()
        yield final


def _tool_message(
    parser: ToolParser, choice: ChoiceState
) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's text read by its tool parser: the message and its finish reason."""
    parser.feed(choice.text)
    parser.finish()
    message = ChatResponseMessage(
        content=parser.content,
        tool_calls=[
            ChatToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parser.calls
        ],
    )
    return message, _finish_reason(choice, parser)


def _finish_reason(choice: ChoiceState, parser: ToolParser | None) -> str | None:
    if parser is not None and parser.calls and choice.finish_reason == "stop":
        return "tool_calls"
    return choice.finish_reason


def _chunk_choice(
    body: ChatCompletionRequest, update: ChoiceUpdate, parser: ToolParser | None
) -> ChatChunkChoice | None:
    """One choice's part of a stream chunk; None when it has nothing to show yet."""
    choice = update.choice
    logprobs = _logprobs(update.logprobs) if body.logprobs else None
    # A token whose text is withheld (half a character, a possible stop string) still gets a
    # chunk, its content empty, as vLLM's: clients time tokens by chunks.
    delta: dict[str, Any] = {"content": update.text} if update.text or update.token_ids else {}
    if parser is not None:
        parsed = [parser.feed(update.text)]
        if choice.is_finished:
            parsed.append(parser.finish())
        delta = _delta(parsed)
    if not delta and logprobs is None and not choice.is_finished:
        return None
    return ChatChunkChoice(
        index=choice.index,
        delta=delta,
        logprobs=logprobs,
        finish_reason=_finish_reason(choice, parser) if choice.is_finished else None,
        stop_reason=choice.stop_reason,
    )


def _delta(parsed: list[ParsedDelta]) -> dict[str, Any]:
    """A stream delta from what a tool parser let through: content and tool-call pieces."""
    delta: dict[str, Any] = {}
    content = "".join(p.content for p in parsed)
    if content:
        delta["content"] = content
    tool_calls = []
    for piece in (call for p in parsed for call in p.tool_calls):
        item: dict[str, Any] = {"index": piece.index}
        if piece.name is not None:
            item.update(id=piece.id, type="function")
        function = {"name": piece.name} if piece.name is not None else {}
        function["arguments"] = piece.arguments
        item["function"] = function
        tool_calls.append(item)
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta


def _logprobs(positions: list[PositionLogprobs]) -> ChatLogprobs:
    content = []
    for position in positions:
        top = [
            TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
            for _, token, logprob in position.top
        ]
        content.append(
            ChatTokenLogprob(
                token=position.token,
                logprob=position.logprob,
                bytes=list(position.token.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)
