"""Serving logic for /v1/completions and /v1/chat/completions.

A request is validated and tokenized here, fanned out into one engine request per choice
(`{id}-{i}`, seed + i), and its engine deltas are turned into text with an
`IncrementalDetokenizer` per choice. A stop string ends a choice: the front aborts it in the
worker and reports finish_reason "stop" with the string as stop_reason.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import jinja2
from pydantic import BaseModel

from nanoserve.engine.outputs import RequestDelta, TokenLogprobs
from nanoserve.engine.request import FinishReason
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.engine_client import (
    EngineClient,
    EngineDeadError,
    RequestRejectedError,
    RequestStream,
)
from nanoserve.server.errors import APIError, error_body
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    TopLogprob,
    UsageInfo,
)
from nanoserve.tokenizer import IncrementalDetokenizer, apply_chat_template

MAX_N = 128
RETRY_AFTER_S = "1"
# Fill-in-the-middle tokens (prefix, suffix, middle) of the code models that have them.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def sse_frame(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: `data: <json>` and the blank line that ends it."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Frame `chunks` as SSE; an error after the 200 headers becomes an error frame; then DONE."""
    try:
        async for chunk in chunks:
            yield sse_frame(chunk)
    except APIError as e:
        yield sse_frame(e.body())
    except EngineDeadError as e:
        yield sse_frame(error_body(str(e), 503))
    except RequestRejectedError as e:
        yield sse_frame(error_body(str(e), 400))
    yield SSE_DONE


@dataclass
class Choice:
    """One choice of a request: one engine request and its detokenizer."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    num_output_tokens: int = 0
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    last_token_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChoiceUpdate:
    """What one delta added to a choice: new text, its logprobs, maybe the end."""

    choice: Choice
    text: str
    logprobs: list[TokenLogprobs]
    is_first: bool


class RequestRun:
    """The engine requests of one API request, from fan-out to the last delta.

    `close()` aborts whatever has not finished; the handler calls it however it ends
    (done, error, client gone).
    """

    def __init__(self, client: EngineClient, metrics: ServerMetrics) -> None:
        self.client = client
        self.metrics = metrics
        self.stream = RequestStream()
        self.choices: dict[str, Choice] = {}
        self.arrival_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.is_complete = False

    def add(self, choice: Choice, params: SamplingParams, count_prompt: bool) -> None:
        self.choices[choice.request_id] = choice
        self.client.add_request(choice.request_id, choice.prompt_token_ids, params, self.stream)
        if count_prompt:
            self.num_prompt_tokens += len(choice.prompt_token_ids)
            self.metrics.prompt_tokens.inc(len(choice.prompt_token_ids))

    @property
    def num_unfinished(self) -> int:
        return sum(not c.is_finished for c in self.choices.values())

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Per burst of deltas, the choices they advanced, until every choice has finished."""
        while self.num_unfinished:
            deltas = [await self.stream.get()]
            while (delta := self.stream.get_nowait()) is not None:
                deltas.append(delta)
            updates = [self._apply(d) for d in deltas if not self.choices[d.request_id].is_finished]
            if updates:
                yield updates
        self.is_complete = True

    def _apply(self, delta: RequestDelta) -> ChoiceUpdate:
        choice = self.choices[delta.request_id]
        now = time.monotonic()
        is_first = choice.last_token_time is None
        num_new = len(delta.new_token_ids)
        if num_new:
            if is_first:
                self.metrics.time_to_first_token.observe(now - self.arrival_time)
                choice.num_cached_tokens = delta.num_cached_tokens
            else:
                for _ in range(num_new):
                    self.metrics.inter_token_latency.observe(
                        (now - choice.last_token_time) / num_new
                    )
            choice.last_token_time = now
            choice.num_output_tokens += num_new
            self.metrics.generation_tokens.inc(num_new)
        if delta.queue_time_s is not None:
            self.metrics.request_queue_time.observe(delta.queue_time_s)
        text = choice.detokenizer.update(delta.new_token_ids)
        if choice.detokenizer.stop_reason is not None:
            # A stop string ended the text; the engine does not know it, so stop it there.
            choice.finish_reason, choice.stop_reason = "stop", choice.detokenizer.stop_reason
            if delta.finish_reason is None:
                self.client.abort([choice.request_id])
        elif delta.finish_reason is not None:
            text += choice.detokenizer.flush()
            choice.finish_reason = str(FinishReason(delta.finish_reason))
            choice.stop_reason = delta.stop_reason
        choice.text += text
        logprobs = list(delta.logprobs or [])
        choice.logprobs.extend(logprobs)
        if choice.is_finished:
            self.metrics.observe_finished(choice.finish_reason)
            self.metrics.e2e_request_latency.observe(now - self.arrival_time)
        return ChoiceUpdate(choice, text, logprobs, is_first)

    def usage(self) -> UsageInfo:
        num_completion = sum(c.num_output_tokens for c in self.choices.values())
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_completion,
            total_tokens=self.num_prompt_tokens + num_completion,
        )

    def close(self) -> bool:
        """Abort unfinished choices; True if the request ended early (client gone, error)."""
        unfinished = [i for i, c in self.choices.items() if not c.is_finished]
        if unfinished:
            self.client.abort(unfinished)
        return not self.is_complete


class OpenAIServing:
    """Validates, tokenizes and runs completion and chat requests against an EngineClient."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        metrics: ServerMetrics,
        served_model_names: list[str],
        max_waiting_requests: int | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.max_waiting_requests = max_waiting_requests
        self._token_text = lru_cache(maxsize=65536)(self._decode_token)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        assert self.client.info is not None
        return self.client.info.max_model_len

    @property
    def num_token_ids(self) -> int:
        """Token ids a prompt may use: known to the tokenizer and inside the model's vocab."""
        assert self.client.info is not None
        return min(self.client.info.vocab_size, len(self.tokenizer))

    # ---- shared checks ----

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(self.served_model_names)}",
                404,
                "model",
            )

    def check_capacity(self) -> None:
        if not self.client.is_ready:
            raise APIError(
                "the model worker is not ready (starting or restarting); retry shortly",
                503,
                headers={"Retry-After": RETRY_AFTER_S},
            )
        limit = self.max_waiting_requests
        if limit is not None and self.client.num_unstarted >= limit:
            raise APIError(
                f"the server is busy: {self.client.num_unstarted} requests are waiting "
                f"(--max-waiting-requests {limit}); retry shortly",
                503,
                headers={"Retry-After": RETRY_AFTER_S},
            )

    def check_prompt(self, prompt_token_ids: list[int], param: str) -> None:
        if not prompt_token_ids:
            raise APIError(f"{param} is empty; give at least one token of input", 400, param)
        limit = self.num_token_ids
        bad = [t for t in prompt_token_ids if not 0 <= t < limit]
        if bad:
            raise APIError(
                f"token ids must be in [0, {limit}), got {bad[:5]} (out of vocabulary)", 400, param
            )
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {num_prompt} input tokens. Please reduce the length of the "
                "input (at least one token must be left for the output).",
                400,
                param,
            )

    def make_params(
        self, request: SamplingFields, max_tokens: int | None, logprobs: int | None, index: int
    ) -> SamplingParams:
        """SamplingParams for choice `index` (its seed is seed + index)."""
        values: dict[str, Any] = {
            name: getattr(request, name)
            for name in (
                "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "stop_token_ids",
                "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
            )
            if getattr(request, name) is not None
        }  # fmt: skip
        if request.stop is not None:
            values["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
        if request.logit_bias is not None:
            try:
                values["logit_bias"] = {int(k): v for k, v in request.logit_bias.items()}
            except ValueError:
                raise APIError(
                    "logit_bias keys must be token ids (integers as strings)", 400, "logit_bias"
                ) from None
        if request.seed is not None:
            if not -(2**63) <= request.seed < 2**63 - MAX_N:
                raise APIError(
                    f"seed must be in [-2^63, 2^63 - {MAX_N}), got {request.seed}", 400, "seed"
                )
            values["seed"] = request.seed + index
        if request.top_k is not None:
            values["top_k"] = min(request.top_k, self.num_token_ids)  # ≥ vocab: no filter
        values.update(max_tokens=max_tokens, logprobs=logprobs)
        try:
            params = SamplingParams(**values)
            params.validate_for_vocab(self.num_token_ids)
        except (ValueError, TypeError) as e:
            message = str(e)
            raise APIError(message, 400, message.split(" ", 1)[0]) from None
        params.n = 1  # the front fans out; each engine request makes one sequence
        return params

    def check_max_tokens(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        if max_tokens is not None and num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {num_prompt} input tokens "
                f"({max_tokens} > {self.max_model_len} - {num_prompt}).",
                400,
                param,
            )

    def start_run(
        self,
        prompts: list[list[int]],
        request: SamplingFields,
        make_params: Callable[[list[int], int], SamplingParams],
        request_id: str,
    ) -> RequestRun:
        """Check capacity, then add one engine request per (prompt, choice)."""
        if not 1 <= request.n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {request.n}", 400, "n")
        self.check_capacity()
        all_params = [
            [make_params(prompt, i) for i in range(request.n)] for prompt in prompts
        ]  # built before anything is added, so a bad value adds nothing
        run = RequestRun(self.client, self.metrics)
        try:
            for prompt_index, (prompt, params_of_choices) in enumerate(
                zip(prompts, all_params, strict=True)
            ):
                for i, params in enumerate(params_of_choices):
                    index = prompt_index * request.n + i
                    detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, params)
                    choice = Choice(index, f"{request_id}-{index}", prompt, detokenizer)
                    run.add(choice, params, count_prompt=i == 0)
        except EngineDeadError as e:
            run.close()
            raise APIError(str(e), 503, headers={"Retry-After": RETRY_AFTER_S}) from None
        return run

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- /v1/completions ----

    def completion_prompts(self, request: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Token ids and text of each prompt (text is used by echo)."""
        prompt = request.prompt
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
        ):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt is empty; give a string or token ids", 400, "prompt")
        token_ids, texts = [], []
        for item in prompt:
            if isinstance(item, str):
                # With a suffix the FIM tokens frame the prompt; no BOS/special tokens inside.
                add_special = request.suffix is None
                ids = self.tokenizer.encode(item, add_special_tokens=add_special) if item else []
                text = item
            else:
                ids, text = list(item), None
            if request.suffix is not None:
                ids = self._fill_in_the_middle(ids, request.suffix)
            self.check_prompt(ids, "prompt")
            token_ids.append(ids)
            texts.append(text if text is not None else self.tokenizer.decode(ids))
        return token_ids, texts

    def _fill_in_the_middle(self, prefix_ids: list[int], suffix: str) -> list[int]:
        """Prefix-suffix-middle order: <prefix> prompt <suffix> suffix <middle>."""
        vocab = self.tokenizer.get_vocab()
        for prefix_token, suffix_token, middle_token in FIM_TOKENS:
            if all(t in vocab for t in (prefix_token, suffix_token, middle_token)):
                suffix_ids = self.tokenizer.encode(suffix, add_special_tokens=False)
                return [
                    vocab[prefix_token], *prefix_ids, vocab[suffix_token], *suffix_ids,
                    vocab[middle_token],
                ]  # fmt: skip
        raise APIError(
            "suffix (fill-in-the-middle) is not supported by this model: its tokenizer has no "
            "FIM tokens such as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>",
            400,
            "suffix",
        )

    def start_completion(self, request: CompletionRequest) -> tuple[RequestRun, list[str]]:
        self.check_model(request.model)
        prompts, texts = self.completion_prompts(request)

        def make_params(prompt: list[int], index: int) -> SamplingParams:
            self.check_max_tokens(len(prompt), request.max_tokens, "max_tokens")
            max_tokens = request.max_tokens
            if max_tokens is None:  # null: the rest of the context
                max_tokens = self.max_model_len - len(prompt)
            return self.make_params(request, max_tokens, request.logprobs, index)

        run = self.start_run(prompts, request, make_params, f"cmpl-{uuid.uuid4().hex}")
        return run, texts

    def _completion_logprobs(
        self, logprobs: list[TokenLogprobs], text_offset: int
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for entry in logprobs:
            token = self._token_text(entry.token_id)
            top: dict[str, float] = {}
            for top_id, top_logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
                # Best first; tokens whose text is the same (e.g. partial bytes) keep the best.
                top.setdefault(self._token_text(top_id), top_logprob)
            top.setdefault(token, entry.logprob)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    def _echo_logprobs(self, prompt_token_ids: list[int]) -> CompletionLogprobs:
        """Prompt tokens for echo: the engine computes no prompt logprobs, so they are null."""
        result, offset = CompletionLogprobs(), 0
        for token_id in prompt_token_ids:
            token = self._token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    async def completion(
        self, request: CompletionRequest, run: RequestRun, texts: list[str]
    ) -> CompletionResponse:
        async for _ in run.updates():
            pass
        response_id = next(iter(run.choices)).rsplit("-", 1)[0]
        choices = []
        for choice in sorted(run.choices.values(), key=lambda c: c.index):
            echo = texts[choice.index // request.n] if request.echo else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = CompletionLogprobs()
                if request.echo:
                    logprobs = self._echo_logprobs(choice.prompt_token_ids)
                generated = self._completion_logprobs(choice.logprobs, len(echo))
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, name).extend(getattr(generated, name))
            choices.append(
                CompletionChoice(
                    index=choice.index,
                    text=echo + choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return CompletionResponse(
            id=response_id, model=self.model_name, choices=choices, usage=run.usage()
        )

    async def completion_chunks(
        self, request: CompletionRequest, run: RequestRun, texts: list[str]
    ) -> AsyncIterator[CompletionResponse]:
        response_id = next(iter(run.choices)).rsplit("-", 1)[0]
        created = int(time.time())
        offsets = {c.index: 0 for c in run.choices.values()}
        async for updates in run.updates():
            choices = []
            for update in updates:
                choice = update.choice
                text = update.text
                if update.is_first and request.echo:
                    text = texts[choice.index // request.n] + text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(update.logprobs, offsets[choice.index])
                offsets[choice.index] += len(text)
                if not text and logprobs is None and not choice.is_finished:
                    continue  # nothing to show yet (e.g. half of a multi-byte character)
                choices.append(
                    CompletionChoice(
                        index=choice.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                    )
                )
            if choices:
                yield CompletionResponse(
                    id=response_id, created=created, model=self.model_name, choices=choices
                )
        if request.stream_options is not None and request.stream_options.include_usage:
            yield CompletionResponse(
                id=response_id,
                created=created,
                model=self.model_name,
                choices=[],
                usage=run.usage(),
            )

    # ---- /v1/chat/completions ----

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        messages = []
        for message in request.messages:
            item = message.model_dump(exclude_none=True)
            if isinstance(message.content, list):
                item["content"] = [p.model_dump(exclude_none=True) for p in message.content]
            item.setdefault("content", "")
            messages.append(item)
        kwargs = dict(request.chat_template_kwargs or {})
        if request.reasoning_effort is not None:
            if request.reasoning_effort not in REASONING_EFFORTS:
                raise APIError(
                    f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                    f"got {request.reasoning_effort!r}",
                    400,
                    "reasoning_effort",
                )
            if request.reasoning_effort == "none":
                kwargs.setdefault("enable_thinking", False)
            else:
                kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        try:
            prompt = apply_chat_template(
                self.tokenizer,
                messages,
                add_generation_prompt=request.add_generation_prompt,
                **kwargs,
            )
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as e:
            raise APIError(f"could not apply the chat template: {e}", 400, "messages") from None
        self.check_prompt(prompt, "messages")
        return prompt

    def start_chat(self, request: ChatCompletionRequest) -> RequestRun:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
        prompt = self.chat_prompt(request)
        param, max_tokens = "max_completion_tokens", request.max_completion_tokens
        if max_tokens is None:
            param, max_tokens = "max_tokens", request.max_tokens
        self.check_max_tokens(len(prompt), max_tokens, param)
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)  # the rest of the context
        logprobs = (request.top_logprobs or 0) if request.logprobs else None

        def make_params(prompt: list[int], index: int) -> SamplingParams:
            return self.make_params(request, max_tokens, logprobs, index)

        return self.start_run([prompt], request, make_params, f"chatcmpl-{uuid.uuid4().hex}")

    def _chat_logprobs(self, logprobs: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for entry in logprobs:
            token = self._token_text(entry.token_id)
            top = [
                TopLogprob(token=(t := self._token_text(i)), logprob=lp, bytes=list(t.encode()))
                for i, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
            ]
            content.append(
                ChatTokenLogprob(
                    token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    async def chat(self, request: ChatCompletionRequest, run: RequestRun) -> ChatCompletionResponse:
        async for _ in run.updates():
            pass
        choices = [
            ChatChoice(
                index=choice.index,
                message=ChatResponseMessage(content=choice.text),
                logprobs=self._chat_logprobs(choice.logprobs) if request.logprobs else None,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for choice in sorted(run.choices.values(), key=lambda c: c.index)
        ]
        response_id = next(iter(run.choices)).rsplit("-", 1)[0]
        return ChatCompletionResponse(
            id=response_id, model=self.model_name, choices=choices, usage=run.usage()
        )

    async def chat_chunks(
        self, request: ChatCompletionRequest, run: RequestRun
    ) -> AsyncIterator[ChatCompletionChunk]:
        response_id = next(iter(run.choices)).rsplit("-", 1)[0]
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=choices
            )

        indexes = sorted(c.index for c in run.choices.values())
        yield chunk(
            [ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""}) for i in indexes]
        )
        async for updates in run.updates():
            choices = []
            for update in updates:
                logprobs = self._chat_logprobs(update.logprobs) if request.logprobs else None
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
