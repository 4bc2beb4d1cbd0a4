"""A request's sampling fields → one checked `SamplingParams`, as completions and chat share them.

Sampling fields the request leaves unset take the model's generation_config.json values
(`ServerConfig.default_sampling`, under --generation-config auto), then SamplingParams' own.
Ranges are checked by `SamplingParams(...)` and `validate_for_vocab`, as the offline `LLM`
checks them, so both give the same messages; what only a server must bound (n, stop strings
searched on the event loop, seeds for n choices, logit_bias keys written as text, max_tokens
against the prompt) is checked here first.
"""

from __future__ import annotations

import dataclasses
import re
import reprlib
from typing import Any

from nanoserve.common.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.server.errors import APIError
from nanoserve.server.openai.api_models import SamplingFields
from nanoserve.server.openai.checks import MAX_LOGPROB_ENTRIES, num_logprob_entries
from nanoserve.server.openai.served_model import ServedModel

MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,12}")
# Request fields that map one to one onto SamplingParams when they are set.
SAMPLING_FIELDS = (
    *("n", "temperature", "top_p", "top_k", "min_p"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty"),
    *("stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens"),
    "skip_special_tokens",
)


def max_tokens_for(
    model: ServedModel, num_prompt: int, max_tokens: int | None, param: str, minimum: int = 1
) -> int:
    """The request's max_tokens, checked against the prompt; unset: the rest of the context, or
    less where the model's generation config says so (its max_new_tokens).

    `minimum` is 0 where a prompt may be run without generating (completions' echo).
    """
    max_model_len = model.max_model_len
    if max_tokens is None:
        rest = max_model_len - num_prompt
        return min(rest, int(model.config.default_sampling.get("max_tokens", rest)))
    if max_tokens < minimum:
        raise APIError(f"{param} must be at least {minimum}, got {max_tokens}", 400, param)
    if num_prompt + max_tokens > max_model_len:
        raise APIError(
            f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {num_prompt} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt}).",
            400,
            param,
        )
    return max_tokens


def fit_logprobs_bound(params: SamplingParams, num_prompt: int) -> SamplingParams:
    """`params` with a max_tokens the request left unset (the rest of the context) lowered so
    that its logprobs fit MAX_LOGPROB_ENTRIES. A max_tokens the request set is kept: a request
    over the bound is refused (`checks.check_logprobs_size`)."""
    if params.logprobs is None or num_logprob_entries(num_prompt, params) <= MAX_LOGPROB_ENTRIES:
        return params
    prompt_entries = num_logprob_entries(num_prompt, dataclasses.replace(params, logprobs=None))
    fitting = (MAX_LOGPROB_ENTRIES - prompt_entries) // (params.n * (params.logprobs + 1))
    return dataclasses.replace(params, max_tokens=max(1, params.min_tokens, fitting))


def sampling_params(
    model: ServedModel,
    request: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None,
) -> SamplingParams:
    """The request's SamplingParams for its n choices (the output processor fans them out).

    `prompt_logprobs` is the request's own field, or what completions' echo makes of logprobs.
    """
    if not 1 <= request.n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {request.n}", 400, "n")
    if request.stream and request.prompt_logprobs:  # (echo's prompt logprobs do stream)
        raise APIError(
            "prompt_logprobs are not available when stream is true", 400, "prompt_logprobs"
        )
    values = _set_fields(request, model.config.default_sampling)
    if "top_k" in values:
        values["top_k"] = min(values["top_k"], model.num_token_ids)  # ≥ vocab: no filter
    values.update(
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs,
    )
    try:
        params = SamplingParams(**values)
    except (ValueError, TypeError) as e:
        message = str(e)  # SamplingParams' messages start with the field's name
        raise APIError(message, 400, message.split(" ", 1)[0]) from None
    try:
        params.validate_for_vocab(model.num_token_ids)
    except ValueError as e:
        raise APIError(str(e), 400, _out_of_vocab_field(params, model.num_token_ids)) from None
    return params


def _out_of_vocab_field(params: SamplingParams, num_token_ids: int) -> str:
    """Which of the fields `validate_for_vocab` reads holds an id outside the vocabulary."""
    if any(not 0 <= token_id < num_token_ids for token_id in params.logit_bias or {}):
        return "logit_bias"
    return "stop_token_ids"


def _set_fields(request: SamplingFields, defaults: Any) -> dict[str, Any]:
    """The sampling fields the request (or else the model's generation config) sets."""
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
        if not -(2**63) <= request.seed < 2**63 - MAX_N:  # choice i samples with seed + i
            raise APIError(
                f"seed must be in [-2^63, 2^63 - {MAX_N}), got {request.seed}", 400, "seed"
            )
        values["seed"] = request.seed
    return values


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
