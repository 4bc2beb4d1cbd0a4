"""POST /v1/chat/completions: messages through the chat template in, an assistant message out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.server.errors import APIError
from nanoserve.server.http import respond
from nanoserve.server.openai.api_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatToolCall,
    FunctionCall,
    TopLogprob,
)
from nanoserve.server.openai.chat_prompt import (
    check_template_kwargs,
    num_content_chars,
    render_chat_prompt,
    request_chat_template,
)
from nanoserve.server.openai.chat_tools import ToolPlan, plan_tools
from nanoserve.server.openai.constraints import checked_constraint
from nanoserve.server.openai.logprobs import vllm_prompt_logprobs
from nanoserve.server.openai.request_run import RequestRun
from nanoserve.server.openai.serving import OpenAIServing, response_id, stream_usage
from nanoserve.server.openai.tool_parsers import ParsedDelta, ToolParser
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.server.state import server_state
from nanoserve.text.output_processor import ChoiceState, ChoiceUpdate, PositionLogprobs

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=json_body_schema(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    body = await read_json_body(request, ChatCompletionRequest, state.config)
    serving = state.chat
    run, tools = await serving.start(body)
    return await respond(
        request,
        run,
        body.stream,
        lambda: serving.chunks(body, run, tools),
        lambda: serving.response(body, run, tools),
    )


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """Extra template variables: chat_template_kwargs, and reasoning_effort mapped onto them."""
    kwargs = check_template_kwargs(request.chat_template_kwargs)
    effort = request.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise APIError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                400,
                "reasoning_effort",
            )
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
        else:
            kwargs.setdefault("reasoning_effort", effort)
    return kwargs


class ChatServing(OpenAIServing):
    """Builds chat runs, responses and stream chunks."""

    async def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        chat_template: str | None,
        kwargs: dict[str, Any],
    ) -> list[int]:
        """Messages rendered with the chat template, as token ids (checked, capped)."""
        template = request_chat_template(chat_template, self.config.trust_request_chat_template)
        self.check_prompt_chars(num_content_chars(messages), "messages")
        prompt = await render_chat_prompt(
            self.pool, messages, add_generation_prompt, template, kwargs, self.max_prompt_chars
        )
        self.check_prompt(prompt, "messages")
        return prompt

    async def prompt(self, request: ChatCompletionRequest, tools: ToolPlan) -> list[int]:
        """The request's messages and tools through the chat template, as token ids."""
        kwargs = template_kwargs(request)
        if tools.template_tools is not None:
            kwargs["tools"] = tools.template_tools  # set by the server, never by the request
        return await self.render(
            request.messages, request.add_generation_prompt, request.chat_template, kwargs
        )

    async def start(self, request: ChatCompletionRequest) -> tuple[RequestRun, ToolPlan]:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
        self.check_capacity(request.n, "n")  # before the template renders anything
        tools = plan_tools(
            request, self.config.tool_call_parser, self.config.enable_auto_tool_choice
        )
        prompt = await self.prompt(request, tools)
        param, max_tokens = "max_completion_tokens", request.max_completion_tokens
        if max_tokens is None:
            param, max_tokens = "max_tokens", request.max_tokens
        self.check_max_tokens(len(prompt), max_tokens, param)
        if max_tokens is None:
            max_tokens = self.default_max_tokens(len(prompt))  # the rest of the context
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        constraint = await checked_constraint(request, tools.constraint)
        params = self.make_params(request, max_tokens, logprobs, structured_outputs=constraint)
        if tools.needs_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return self.start_run([prompt], [params], "chatcmpl"), tools

    async def response(
        self, request: ChatCompletionRequest, run: RequestRun, tools: ToolPlan
    ) -> ChatCompletionResponse:
        async for _ in run.updates():
            pass
        choices = []
        for choice in run.choices:
            message, finish_reason = ChatResponseMessage(content=choice.text), choice.finish_reason
            if tools.make_parser is not None:
                message, finish_reason = _tool_message(tools.make_parser(), choice)
            choices.append(
                ChatChoice(
                    index=choice.index,
                    message=message,
                    logprobs=_logprobs(choice.logprobs) if request.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=response_id(run),
            model=self.model_name,
            choices=choices,
            usage=run.usage(),
            prompt_logprobs=vllm_prompt_logprobs(run.choices[0]),
        )

    async def chunks(
        self, request: ChatCompletionRequest, run: RequestRun, tools: ToolPlan
    ) -> AsyncIterator[ChatCompletionChunk]:
        chunk_id, created = response_id(run), int(time.time())
        include_usage, continuous_usage = stream_usage(request.stream_options)

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=chunk_id,
                created=created,
                model=self.model_name,
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
            choices = [_chunk_choice(request, u, parsers.get(u.choice.index)) for u in updates]
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
    request: ChatCompletionRequest, update: ChoiceUpdate, parser: ToolParser | None
) -> ChatChunkChoice | None:
    """One choice's part of a stream chunk; None when it has nothing to show yet."""
    choice = update.choice
    logprobs = _logprobs(update.logprobs) if request.logprobs else None
    delta: dict[str, Any] = {"content": update.text} if update.text else {}
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
