"""POST /v1/completions: prompts (text or token ids, fill-in-the-middle) in, text out.

With `echo` the prompt comes back before the completion, and with `logprobs` too the prompt
tokens' logprobs before the generated ones' (the first prompt token's are null): this is how
lm-eval scores a continuation. `max_tokens: 0` is allowed with `echo` only: the prompt (and
its logprobs) without generation.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.http import respond
from nanoserve.server.openai.api_models import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from nanoserve.server.openai.constraints import checked_constraint
from nanoserve.server.openai.logprobs import (
    append_completion_logprobs,
    prompt_positions,
    vllm_prompt_logprobs,
)
from nanoserve.server.openai.request_run import RequestRun
from nanoserve.server.openai.serving import OpenAIServing, response_id, stream_usage
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.server.state import server_state
from nanoserve.text.output_processor import ChoiceState, ChoiceUpdate

# Fill-in-the-middle tokens (prefix, suffix, middle) of the code models that have them.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)

router = APIRouter()


@router.post("/v1/completions", openapi_extra=json_body_schema(CompletionRequest))
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    body = await read_json_body(request, CompletionRequest, state.config)
    serving = state.completions
    run, texts = await serving.start(body)
    return await respond(
        request,
        run,
        body.stream,
        lambda: serving.chunks(body, run, texts),
        lambda: serving.response(body, run, texts),
    )


class CompletionServing(OpenAIServing):
    """Builds completion runs, responses and stream chunks."""

    async def start(self, request: CompletionRequest) -> tuple[RequestRun, list[str]]:
        """Validate and start the request; also returns each prompt's text (for echo)."""
        self.check_model(request.model)
        items = self.prompt_items(request)
        # Before any tokenizing: every choice of every prompt must fit in the waiting queue.
        self.check_capacity(len(items) * request.n, "n" if request.n > 1 else "prompt")
        prompts, texts = await self.prompts(request, items)
        constraint = await checked_constraint(request)
        params = [self._params(request, prompt, constraint) for prompt in prompts]
        return self.start_run(prompts, params, "cmpl"), texts

    def _params(
        self,
        request: CompletionRequest,
        prompt: list[int],
        constraint: StructuredOutputsParams | None,
    ) -> SamplingParams:
        minimum = 0 if request.echo else 1  # echo with max_tokens 0: the prompt only
        self.check_max_tokens(len(prompt), request.max_tokens, "max_tokens", minimum)
        max_tokens = request.max_tokens
        if max_tokens is None:  # null: the rest of the context
            max_tokens = self.default_max_tokens(len(prompt))
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs  # echoed prompt tokens get logprobs too
        return self.make_params(
            request, max_tokens, request.logprobs, prompt_logprobs, structured_outputs=constraint
        )

    @staticmethod
    def prompt_items(request: CompletionRequest) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        prompt: list = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]  # one prompt of token ids
        if not prompt:
            raise APIError("prompt is empty; give a string or token ids", 400, "prompt")
        return prompt

    async def prompts(
        self, request: CompletionRequest, items: list[str | list[int]]
    ) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt, and its text when echo asks for it."""
        token_ids, texts = [], []
        for item in items:
            if isinstance(item, str):
                self.check_prompt_chars(len(item) + len(request.suffix or ""), "prompt")
                # With a suffix the FIM tokens frame the prompt; no BOS/special tokens inside.
                add_special = request.suffix is None
                ids = await self.pool.encode(item, add_special) if item else []
            else:
                ids = item
            if request.suffix is not None:
                ids = await self._fill_in_the_middle(ids, request.suffix)
            self.check_prompt(ids, "prompt")
            token_ids.append(ids)
            if not request.echo:
                texts.append("")
            else:
                texts.append(item if isinstance(item, str) else await self.pool.decode(ids))
        return token_ids, texts

    @functools.cached_property
    def fim_token_ids(self) -> tuple[int, int, int] | None:
        """Ids of the tokenizer's fill-in-the-middle tokens (prefix, suffix, middle), if any."""
        vocab = self.tokenizer.get_vocab()
        for tokens in FIM_TOKENS:
            if all(t in vocab for t in tokens):
                return vocab[tokens[0]], vocab[tokens[1]], vocab[tokens[2]]
        return None

    async def _fill_in_the_middle(self, prefix_ids: list[int], suffix: str) -> list[int]:
        """Prefix-suffix-middle order: <prefix> prompt <suffix> suffix <middle>."""
        if self.fim_token_ids is None:
            raise APIError(
                "suffix (fill-in-the-middle) is not supported by this model: its tokenizer has "
                "no FIM tokens such as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>",
                400,
                "suffix",
            )
        prefix_id, suffix_id, middle_id = self.fim_token_ids
        suffix_ids = await self.pool.encode(suffix, add_special_tokens=False)
        return [prefix_id, *prefix_ids, suffix_id, *suffix_ids, middle_id]

    async def response(
        self, request: CompletionRequest, run: RequestRun, texts: list[str]
    ) -> CompletionResponse:
        async for _ in run.updates():
            pass
        choices: list[CompletionChoice] = [
            self._response_choice(request, choice, texts[choice.prompt_index])
            for choice in run.choices
        ]
        return CompletionResponse(
            id=response_id(run), model=self.model_name, choices=choices, usage=run.usage()
        )

    def _response_choice(
        self, request: CompletionRequest, choice: ChoiceState, prompt_text: str
    ) -> CompletionResponseChoice:
        echo = prompt_text if request.echo else ""
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            if request.echo:
                self._append_prompt_logprobs(logprobs, choice)
            append_completion_logprobs(
                logprobs, choice.token_ids, choice.logprobs, len(echo), self.token_text
            )
        return CompletionResponseChoice(
            index=choice.index,
            text=echo + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_logprobs=vllm_prompt_logprobs(choice),
        )

    async def chunks(
        self, request: CompletionRequest, run: RequestRun, texts: list[str]
    ) -> AsyncIterator[CompletionResponse]:
        chunk_id, created = response_id(run), int(time.time())
        include_usage, continuous_usage = stream_usage(request.stream_options)
        offsets = {c.index: 0 for c in run.choices}  # text sent so far, per choice
        async for updates in run.updates():
            choices = []
            for update in updates:
                choice = self._chunk_choice(request, update, texts, offsets)
                if choice is not None:
                    choices.append(choice)
            if choices:
                yield CompletionResponse(
                    id=chunk_id,
                    created=created,
                    model=self.model_name,
                    choices=choices,
                    usage=run.usage() if continuous_usage else None,
                )
        if include_usage:
            yield CompletionResponse(
                id=chunk_id, created=created, model=self.model_name, choices=[], usage=run.usage()
            )

    def _chunk_choice(
        self,
        request: CompletionRequest,
        update: ChoiceUpdate,
        texts: list[str],
        offsets: dict[int, int],
    ) -> CompletionChoice | None:
        """One choice's part of a stream chunk; None when it has nothing to show yet."""
        choice = update.choice
        text = update.text
        logprobs = None if request.logprobs is None else CompletionLogprobs()
        if update.is_first and request.echo:
            prompt_text = texts[choice.prompt_index]
            if logprobs is not None:
                self._append_prompt_logprobs(logprobs, choice)
            offsets[choice.index] += len(prompt_text)
            text = prompt_text + text
        if logprobs is not None:
            append_completion_logprobs(
                logprobs, update.token_ids, update.logprobs, offsets[choice.index], self.token_text
            )
        offsets[choice.index] += len(update.text)
        if not text and logprobs is None and not choice.is_finished:
            return None  # e.g. half of a multi-byte character
        return CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )

    def _append_prompt_logprobs(self, logprobs: CompletionLogprobs, choice: ChoiceState) -> None:
        """The echoed prompt's tokens, text offsets from 0 (the first token's logprob is null)."""
        positions = prompt_positions(choice)
        append_completion_logprobs(logprobs, choice.prompt_token_ids, positions, 0, self.token_text)
