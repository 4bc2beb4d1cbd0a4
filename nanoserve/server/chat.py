"""POST /v1/chat/completions: messages through the chat template in, an assistant message out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.output_processor import PositionLogprobs
from nanoserve.server.api_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from nanoserve.server.errors import APIError
from nanoserve.server.http import read_json_body, respond
from nanoserve.server.request_run import RequestRun
from nanoserve.server.serving import OpenAIServing, response_id
from nanoserve.server.state import server_state
from nanoserve.server.structured_outputs import checked_constraint
from nanoserve.tokenizer import apply_chat_template

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    state.check_api_key(request)
    body = await read_json_body(request, ChatCompletionRequest, state.config.max_body_bytes)
    serving = state.chat
    run = await serving.start(body)
    return await respond(
        request,
        run,
        body.stream,
        lambda: serving.chunks(body, run),
        lambda: serving.response(body, run),
    )


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: plain dicts, content never missing."""
    rendered = []
    for message in messages:
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            item["content"] = [p.model_dump(exclude_none=True) for p in message.content]
        item.setdefault("content", "")
        rendered.append(item)
    return rendered


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """Extra template variables: chat_template_kwargs, and reasoning_effort mapped onto them."""
    kwargs = dict(request.chat_template_kwargs or {})
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

    def prompt(self, request: ChatCompletionRequest) -> list[int]:
        try:
            prompt = apply_chat_template(
                self.tokenizer,
                template_messages(request.messages),
                add_generation_prompt=request.add_generation_prompt,
                **template_kwargs(request),
            )
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as e:
            raise APIError(f"could not apply the chat template: {e}", 400, "messages") from None
        self.check_prompt(prompt, "messages")
        return prompt

    async def start(self, request: ChatCompletionRequest) -> RequestRun:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
        prompt = self.prompt(request)
        param, max_tokens = "max_completion_tokens", request.max_completion_tokens
        if max_tokens is None:
            param, max_tokens = "max_tokens", request.max_tokens
        self.check_max_tokens(len(prompt), max_tokens, param)
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)  # the rest of the context
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        constraint = await checked_constraint(request)
        params = self.make_params(request, max_tokens, logprobs, constraint)
        return self.start_run([prompt], [params], "chatcmpl")

    async def response(
        self, request: ChatCompletionRequest, run: RequestRun
    ) -> ChatCompletionResponse:
        async for _ in run.updates():
            pass
        choices = [
            ChatChoice(
                index=choice.index,
                message=ChatResponseMessage(content=choice.text),
                logprobs=_logprobs(choice.logprobs) if request.logprobs else None,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for choice in run.choices
        ]
        return ChatCompletionResponse(
            id=response_id(run), model=self.model_name, choices=choices, usage=run.usage()
        )

    async def chunks(
        self, request: ChatCompletionRequest, run: RequestRun
    ) -> AsyncIterator[ChatCompletionChunk]:
        chunk_id, created = response_id(run), int(time.time())

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=chunk_id, created=created, model=self.model_name, choices=choices
            )

        yield chunk(
            [
                ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""})
                for c in run.choices
            ]
        )
        async for updates in run.updates():
            choices = []
            for update in updates:
                logprobs = _logprobs(update.logprobs) if request.logprobs else None
                if not update.text and logprobs is None and not update.choice.is_finished:
                    continue
                choices.append(
                    ChatChunkChoice(
                        index=update.choice.index,
                        delta={"content": update.text} if update.text else {},
                        logprobs=logprobs,
                        finish_reason=update.choice.finish_reason,
                        stop_reason=update.choice.stop_reason,
                    )
                )
            if choices:
                yield chunk(choices)
        if request.stream_options is not None and request.stream_options.include_usage:
            final = chunk([])
            final.usage = run.usage()
            yield final


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
