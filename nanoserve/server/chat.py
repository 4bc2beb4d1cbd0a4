"""POST /v1/chat/completions: messages through the chat template in, an assistant message out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

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
from nanoserve.server.chat_prompt import (
    check_template_kwargs,
    num_content_chars,
    render_chat_prompt,
    request_chat_template,
)
from nanoserve.server.errors import APIError
from nanoserve.server.http import respond
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.server.request_run import RequestRun
from nanoserve.server.serving import OpenAIServing, response_id
from nanoserve.server.state import server_state

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=json_body_schema(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    body = await read_json_body(request, ChatCompletionRequest, state.config)
    serving = state.chat
    run = await serving.start(body)
    return await respond(
        request,
        run,
        body.stream,
        lambda: serving.chunks(body, run),
        lambda: serving.response(body, run),
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

    async def prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        chat_template: str | None,
        kwargs: dict[str, Any],
    ) -> list[int]:
        """The messages rendered with the chat template, as token ids (checked, capped)."""
        template = request_chat_template(chat_template, self.config.trust_request_chat_template)
        self.check_prompt_chars(num_content_chars(messages), "messages")
        prompt = await render_chat_prompt(
            self.pool, messages, add_generation_prompt, template, kwargs, self.max_prompt_chars
        )
        self.check_prompt(prompt, "messages")
        return prompt

    async def start(self, request: ChatCompletionRequest) -> RequestRun:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
        self.check_capacity(request.n, "n")  # before the template renders anything
        prompt = await self.prompt(
            request.messages,
            request.add_generation_prompt,
            request.chat_template,
            template_kwargs(request),
        )
        param, max_tokens = "max_completion_tokens", request.max_completion_tokens
        if max_tokens is None:
            param, max_tokens = "max_tokens", request.max_tokens
        self.check_max_tokens(len(prompt), max_tokens, param)
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)  # the rest of the context
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.make_params(request, max_tokens, logprobs)
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
