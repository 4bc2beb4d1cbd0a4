"""What every generation endpoint shares: validation of the model, capacity, prompt and
sampling fields, and starting a `RequestRun` (completions.py and chat.py build on it)."""

from __future__ import annotations

import re
import reprlib
import uuid
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from nanoserve.client.engine_client import EngineClient, EngineDeadError
from nanoserve.common.protocol import Ready
from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.openai.api_models import SamplingFields, StreamOptions
from nanoserve.server.openai.request_run import RequestRun
from nanoserve.server.state import ServerConfig
from nanoserve.server.tokenizer_pool import TokenizerPool
from nanoserve.text.output_processor import TOKEN_TEXT_CACHE_SIZE, OutputProcessor

MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,12}")
# Prompt logprobs one request may ask for: prompt tokens x choices x (prompt_logprobs + 1).
# Each entry costs the worker and the front ~100-200 bytes until the response is sent; lm-eval's
# requests (a few prompts of up to a few thousand tokens, prompt_logprobs 1) need far fewer.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 20
RETRY_AFTER_S = "1"
# Request fields that map one to one onto SamplingParams when they are set.
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens",
)  # fmt: skip


def service_unavailable(message: str) -> APIError:
    return APIError(message, 503, headers={"Retry-After": RETRY_AFTER_S})


class OpenAIServing:
    """Checks and run start-up shared by the completion and chat endpoints."""

    def __init__(
        self,
        client: EngineClient,
        pool: TokenizerPool,
        metrics: ServerMetrics,
        config: ServerConfig,
    ) -> None:
        self.client = client
        self.pool = pool
        self.tokenizer = pool.tokenizer
        self.metrics = metrics
        self.config = config
        self.served_model_names = list(config.served_model_names)
        self.max_waiting_requests = config.max_waiting_requests
        # No token is longer than this (vocab strings are at least as long as their text).
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.token_text: Callable[[int], str] = lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)(
            lambda token_id: pool.decode_now([token_id])
        )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def engine_info(self) -> Ready:
        """What the worker said when it became ready (503 until the first worker has)."""
        if self.client.info is None:
            raise service_unavailable("the model worker has not started yet; retry shortly")
        return self.client.info

    @property
    def max_model_len(self) -> int:
        return self.engine_info.max_model_len

    @property
    def num_token_ids(self) -> int:
        """Token ids a prompt may use: known to the tokenizer and inside the model's vocab."""
        return min(self.engine_info.vocab_size, len(self.tokenizer))

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt text taken: --max-prompt-chars, or what could fit in max_model_len."""
        if self.config.max_prompt_chars is not None:
            return self.config.max_prompt_chars
        return self.max_model_len * self.max_token_chars

    def check_model(self, model: str | None) -> None:
        """Unknown names are a 404; a missing or empty name means the served model (vLLM)."""
        if model and model not in self.served_model_names:
            raise APIError(
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(self.served_model_names)}",
                404,
                "model",
            )

    def check_capacity(self, num_requests: int = 1, param: str | None = None) -> None:
        """503 unless `num_requests` engine requests (prompts × n) fit in the waiting queue."""
        if not self.client.is_ready:
            reason = "starting or restarting" if self.client.is_accepting else "shutting down"
            raise service_unavailable(f"the model worker is not ready ({reason}); retry shortly")
        limit = self.max_waiting_requests
        if limit is None:
            return
        if num_requests > limit:
            raise APIError(
                f"this request needs {num_requests} engine requests (prompts × n), more than "
                f"the waiting queue holds (--max-waiting-requests {limit}); send fewer prompts "
                "or choices per request",
                400,
                param,
            )
        if self.client.num_unstarted + num_requests > limit:
            raise service_unavailable(
                f"the server is busy: {self.client.num_unstarted} requests are waiting "
                f"(--max-waiting-requests {limit}); retry shortly"
            )

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 before tokenizing a text that cannot fit (or is over --max-prompt-chars)."""
        limit = self.max_prompt_chars
        if num_chars > limit:
            raise APIError(
                f"{param}: {num_chars} characters of text; this server takes at most {limit} "
                f"characters per prompt (--max-prompt-chars; by default what "
                f"{self.max_model_len} tokens of at most {self.max_token_chars} characters hold)",
                400,
                param,
            )

    def check_prompt(self, prompt_token_ids: list[int], param: str) -> None:
        if not prompt_token_ids:
            raise APIError(f"{param} is empty; give at least one token of input", 400, param)
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {num_prompt} input tokens. Please reduce the length of the "
                "input (at least one token must be left for the output).",
                400,
                param,
            )
        limit = self.num_token_ids
        bad = [t for t in prompt_token_ids if not 0 <= t < limit]
        if bad:
            raise APIError(
                f"token ids must be in [0, {limit}), got {bad[:5]} (out of vocabulary)", 400, param
            )

    def check_max_tokens(
        self, num_prompt: int, max_tokens: int | None, param: str, minimum: int = 1
    ) -> None:
        """`minimum` is 0 where a prompt may be run without generating (completions' echo)."""
        if max_tokens is not None and max_tokens < minimum:
            raise APIError(f"{param} must be at least {minimum}, got {max_tokens}", 400, param)
        if max_tokens is not None and num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {num_prompt} input tokens "
                f"({max_tokens} > {self.max_model_len} - {num_prompt}).",
                400,
                param,
            )

    def default_max_tokens(self, num_prompt: int) -> int:
        """max_tokens for a request that sets none: the rest of the context, or less where the
        model's generation config says so (its max_new_tokens)."""
        rest = self.max_model_len - num_prompt
        return min(rest, int(self.config.default_sampling.get("max_tokens", rest)))

    def make_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams (n choices; the output processor fans them out).

        `prompt_logprobs` defaults to the request's own field (completions' echo sets it).
        """
        if not 1 <= request.n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {request.n}", 400, "n")
        if request.stream and request.prompt_logprobs:
            raise APIError(
                "prompt_logprobs are not available when stream is true", 400, "prompt_logprobs"
            )
        defaults = self.config.default_sampling  # the model's, for fields the request left unset
        values: dict[str, Any] = {}
        for name in SAMPLING_FIELDS:
            value = getattr(request, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        if request.stop is not None:
            values["stop"] = _stop_strings(request.stop)
        if request.stop_token_ids is not None:  # looked up per token in the worker: no repeats
            values["stop_token_ids"] = sorted(set(request.stop_token_ids))
        if request.logit_bias is not None:
            values["logit_bias"] = _logit_bias(request.logit_bias)
        if request.seed is not None:
            if not -(2**63) <= request.seed < 2**63 - MAX_N:
                raise APIError(
                    f"seed must be in [-2^63, 2^63 - {MAX_N}), got {request.seed}", 400, "seed"
                )
            values["seed"] = request.seed
        if "top_k" in values:
            values["top_k"] = min(values["top_k"], self.num_token_ids)  # ≥ vocab: no filter
        if prompt_logprobs is None:
            prompt_logprobs = request.prompt_logprobs
        values.update(
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
        )
        try:
            params = SamplingParams(**values)
            params.validate_for_vocab(self.num_token_ids)
        except (ValueError, TypeError) as e:
            message = str(e)
            raise APIError(message, 400, message.split(" ", 1)[0]) from None
        return params

    def start_run(
        self, prompts: list[list[int]], params: list[SamplingParams], id_prefix: str
    ) -> RequestRun:
        """Check sizes and capacity for every choice of every prompt, then add them."""
        check_prompt_logprobs_size(prompts, params)
        num_choices = [p.n for p in params]
        self.check_capacity(sum(num_choices), "n" if max(num_choices) > 1 else "prompt")
        processor = OutputProcessor(self.tokenizer, self.token_text)
        run = RequestRun(self.client, self.metrics, processor)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        try:
            for index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
                run.add_prompt(request_id, prompt, prompt_params, index)
        except EngineDeadError as e:
            run.close()
            raise service_unavailable(str(e)) from None
        return run


def _stop_strings(stop: str | list[str]) -> list[str]:
    """Stop strings are searched on the event loop after every token: a few, and short."""
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(
            f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", 400, "stop"
        )
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise APIError(
            f"stop strings may be at most {MAX_STOP_CHARS} characters, got one of {longest}",
            400,
            "stop",
        )
    return stops


def _logit_bias(logit_bias: dict[str, float]) -> dict[int, float]:
    """Keys are token ids in ASCII digits only (int() would also take " 1 ", "1_0", "١")."""
    bad = [key for key in logit_bias if not _TOKEN_ID_KEY.fullmatch(key)]
    if bad:
        raise APIError(
            f'logit_bias keys must be token ids written in ASCII digits, like "42"; got '
            f"{reprlib.repr(bad[0])}",
            400,
            "logit_bias",
        )
    return {int(k): v for k, v in logit_bias.items()}


def check_prompt_logprobs_size(prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Refuse a request whose prompt logprobs would hold more than MAX_PROMPT_LOGPROB_ENTRIES."""
    num_entries = sum(
        p.n * (len(prompt) - 1) * (p.prompt_logprobs + 1)
        for prompt, p in zip(prompts, params, strict=True)
        if p.prompt_logprobs is not None
    )
    if num_entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise APIError(
            f"prompt logprobs for this request would hold {num_entries} entries (prompt tokens "
            f"x n x (prompt_logprobs + 1), with echo and logprobs too); the limit is "
            f"{MAX_PROMPT_LOGPROB_ENTRIES}: send fewer or shorter prompts, or lower n or "
            "prompt_logprobs",
            400,
            "prompt_logprobs",
        )


def stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk): vLLM's `stream_options`, where
    `continuous_usage_stats` counts only with `include_usage`."""
    if options is None:
        return False, False
    return options.include_usage, options.include_usage and options.continuous_usage_stats


def response_id(run: RequestRun) -> str:
    """The API id of a run: its engine request ids without the choice suffix."""
    return run.choices[0].request_id.rsplit("-", 1)[0]
