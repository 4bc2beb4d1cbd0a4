"""POST /v1/completions: prompts (text or token ids, fill-in-the-middle) in, text out.

One request, top to bottom: the route reads the body; `start_completion` checks it, tokenizes
each prompt (framing it with FIM tokens when a suffix is given), builds each prompt's sampling
params and starts the run; then the run is answered as a stream of chunks
(`completion_chunks`) or one completion (`completion`).

With `echo` the prompt comes back before the completion, and with `logprobs` too the prompt
tokens' logprobs before the generated ones' (the first prompt token's are null): this is how
lm-eval scores a continuation. `max_tokens: 0` is allowed with `echo` only: the prompt (and
its logprobs) without generation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.server.errors import APIError
from nanoserve.server.openai.api_models import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from nanoserve.server.openai.checks import (
    check_capacity,
    check_model,
    check_prompt,
    check_prompt_chars,
)
from nanoserve.server.openai.constraints import Constraint, request_constraint
from nanoserve.server.openai.logprobs import (
    append_completion_logprobs,
    prompt_positions,
    vllm_prompt_logprobs,
)
from nanoserve.server.openai.request_run import (
    RequestRun,
    start_run,
    stream_answer,
    stream_usage,
    whole_answer,
)
from nanoserve.server.openai.sampling import fit_logprobs_bound, max_tokens_for, sampling_params
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.text.output_processor import ChoiceState, ChoiceUpdate

# Fill-in-the-middle tokens (prefix, suffix, middle) of the code models that have them.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
FimTokenIds = tuple[int, int, int]  # prefix, suffix, middle


def router(model: ServedModel) -> APIRouter:
    """The completions route, serving `model`."""
    routes = APIRouter()
    fim_ids = fim_token_ids(model.tokenizer)

    @routes.post("/v1/completions", openapi_extra=json_body_schema(CompletionRequest))
    async def create_completion(request: Request) -> Response:
        body = await read_json_body(request, CompletionRequest, model.config)
        run, texts = await start_completion(model, body, request, fim_ids)
        if body.stream:
            return stream_answer(run, completion_chunks(model, body, run, texts))
        return await whole_answer(request, run, completion(model, body, run, texts))

    return routes


async def start_completion(
    model: ServedModel, body: CompletionRequest, request: Request, fim_ids: FimTokenIds | None
) -> tuple[RequestRun, list[str]]:
    """Checks, prompts, sampling params, then the run; also each prompt's text (for echo)."""
    check_model(model, body.model)
    items = prompt_items(body)
    # Before any tokenizing: every choice of every prompt must fit in the waiting queue.
    check_capacity(model, len(items) * body.n, "n" if body.n > 1 else "prompt")
    constraint = request_constraint(body)  # bounded before anything is tokenized
    prompts, texts = await _prompts(model, body, items, fim_ids)
    params = [_sampling_params(model, body, len(prompt), constraint) for prompt in prompts]
    run = await start_run(model, request, prompts, params, "cmpl", constraint)
    return run, texts


def prompt_items(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, each a string or a list of token ids."""
    prompt: list = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]  # one prompt of token ids
    if not prompt:
        raise APIError("prompt is empty; give a string or token ids", 400, "prompt")
    return prompt


async def _prompts(
    model: ServedModel,
    body: CompletionRequest,
    items: list[str | list[int]],
    fim_ids: FimTokenIds | None,
) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt (checked), and its text when echo asks for it."""
    token_ids, texts = [], []
    for item in items:
        if isinstance(item, str):
            check_prompt_chars(model, len(item) + len(body.suffix or ""), "prompt")
            # With a suffix the FIM tokens frame the prompt; no BOS/special tokens inside.
            add_special = body.suffix is None
            ids = await model.pool.encode(item, add_special) if item else []
        else:
            ids = item
        if body.suffix is not None:
            ids = await _fill_in_the_middle(model, ids, body.suffix, fim_ids)
        check_prompt(model, ids, "prompt")
        token_ids.append(ids)
        if not body.echo:
            texts.append("")
        else:
            texts.append(item if isinstance(item, str) else await model.pool.decode(ids))
    return token_ids, texts


def fim_token_ids(tokenizer: PreTrainedTokenizerBase) -> FimTokenIds | None:
    """Ids of the tokenizer's fill-in-the-middle tokens (prefix, suffix, middle), if any."""
    vocab = tokenizer.get_vocab()
    for tokens in FIM_TOKENS:
        if all(t in vocab for t in tokens):
            return vocab[tokens[0]], vocab[tokens[1]], vocab[tokens[2]]
    return None


async def _fill_in_the_middle(
    model: ServedModel, prefix_ids: list[int], suffix: str, fim_ids: FimTokenIds | None
) -> list[int]:
    """Prefix-suffix-middle order: <prefix> prompt <suffix> suffix <middle>."""
    if fim_ids is None:
        raise APIError(
            "suffix (fill-in-the-middle) is not supported by this model: its tokenizer has "
            "no FIM tokens such as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>",
            400,
            "suffix",
        )
    prefix_id, suffix_id, middle_id = fim_ids
    suffix_ids = await model.pool.encode(suffix, add_special_tokens=False)
    return [prefix_id, *prefix_ids, suffix_id, *suffix_ids, middle_id]


def _sampling_params(
    model: ServedModel, body: CompletionRequest, num_prompt: int, constraint: Constraint | None
) -> SamplingParams:
    minimum = 0 if body.echo else 1  # echo with max_tokens 0: the prompt only
    max_tokens = max_tokens_for(model, num_prompt, body.max_tokens, "max_tokens", minimum)
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo:
        prompt_logprobs = body.logprobs  # echoed prompt tokens get logprobs too
    structured = constraint.params if constraint is not None else None
    params = sampling_params(model, body, max_tokens, body.logprobs, prompt_logprobs, structured)
    return fit_logprobs_bound(params, num_prompt) if body.max_tokens is None else params


async def completion(
    model: ServedModel, body: CompletionRequest, run: RequestRun, texts: list[str]
) -> CompletionResponse:
    """The whole completion, once every choice has finished."""
    await run.finish()
    choices: list[CompletionChoice] = [
        _response_choice(model, body, choice, texts[choice.prompt_index]) for choice in run.choices
    ]
    return CompletionResponse(
        id=run.request_id, model=model.name, choices=choices, usage=run.usage()
    )


def _response_choice(
    model: ServedModel, body: CompletionRequest, choice: ChoiceState, prompt_text: str
) -> CompletionResponseChoice:
    echo = prompt_text if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        logprobs = CompletionLogprobs()
        if body.echo:
            _append_prompt_logprobs(model, logprobs, choice)
        append_completion_logprobs(
            logprobs, choice.token_ids, choice.logprobs, len(echo), model.token_text
        )
    return CompletionResponseChoice(
        index=choice.index,
        text=echo + choice.text,
        logprobs=logprobs,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        prompt_logprobs=vllm_prompt_logprobs(choice),
    )


async def completion_chunks(
    model: ServedModel, body: CompletionRequest, run: RequestRun, texts: list[str]
) -> AsyncIterator[CompletionResponse]:
    """The stream: a chunk per burst of updates, and usage if asked for."""
    created = int(time.time())
    include_usage, continuous_usage = stream_usage(body.stream_options)
    offsets = {c.index: 0 for c in run.choices}  # text sent so far, per choice
    async for updates in run.updates():
        choices = []
        for update in updates:
            choice = _chunk_choice(model, body, update, texts, offsets)
            if choice is not None:
                choices.append(choice)
        if choices:
            yield CompletionResponse(
                id=run.request_id,
                created=created,
                model=model.name,
                choices=choices,
                usage=run.usage() if continuous_usage else None,
            )
    if include_usage:
        yield CompletionResponse(
            id=run.request_id, created=created, model=model.name, choices=[], usage=run.usage()
        )


def _chunk_choice(
    model: ServedModel,
    body: CompletionRequest,
    update: ChoiceUpdate,
    texts: list[str],
    offsets: dict[int, int],
) -> CompletionChoice | None:
    """One choice's part of a stream chunk; None when it has nothing to show yet."""
    choice = update.choice
    text = update.text
    logprobs = None if body.logprobs is None else CompletionLogprobs()
    if update.is_first and body.echo:
        prompt_text = texts[choice.prompt_index]
        if logprobs is not None:
            _append_prompt_logprobs(model, logprobs, choice)
        offsets[choice.index] += len(prompt_text)
        text = prompt_text + text
    if logprobs is not None:
        append_completion_logprobs(
            logprobs, update.token_ids, update.logprobs, offsets[choice.index], model.token_text
        )
    offsets[choice.index] += len(update.text)
    if not text and not update.token_ids and logprobs is None and not choice.is_finished:
        return None  # nothing new (a token whose text is withheld still gets a chunk, as vLLM's)
    return CompletionChoice(
        index=choice.index,
        text=text,
        logprobs=logprobs,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
    )


def _append_prompt_logprobs(
    model: ServedModel, logprobs: CompletionLogprobs, choice: ChoiceState
) -> None:
    """The echoed prompt's tokens, text offsets from 0 (the first token's logprob is null)."""
    positions = prompt_positions(choice)
    append_completion_logprobs(logprobs, choice.prompt_token_ids, positions, 0, model.token_text)
