"""What the front checks before a request reaches the engine, each check written once here.

The engine trusts the requests it is sent, so whatever it could not run is refused here, as a
4xx that says what was wrong: an unknown model name (404), no room in the waiting queue (503,
or 400 for a request that could never fit), prompt text too long to tokenize, and prompt token
ids that are empty, do not fit the context or are outside the vocabulary, logprobs that could
outgrow MAX_LOGPROB_ENTRIES, `metadata` past OpenAI's limits. The sampling fields are checked
where SamplingParams are built (`sampling.py`); structured-output fields where they become one
constraint (`constraints.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.server.errors import APIError, service_unavailable
from nanoserve.server.openai.served_model import ServedModel

# Logprob entries one request may ask for, prompt and generated tokens together: per choice,
# prompt tokens x (prompt_logprobs + 1) + max_tokens x (logprobs + 1). Each entry costs the
# worker and the front ~100-200 bytes until the response is sent, and ~50 bytes of the answer;
# lm-eval's requests (a few prompts of up to a few thousand tokens, prompt_logprobs 1) and a
# chat answer of 40,000 tokens with top_logprobs 20 need fewer.
MAX_LOGPROB_ENTRIES = 1 << 20
# /detokenize takes this many contexts' worth of ids per call.
DETOKENIZE_CONTEXTS = 2
# OpenAI's limits on `metadata`: what a stored response keeps of it is bounded.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def check_model(model: ServedModel, name: str | None) -> None:
    """Unknown names are a 404; a missing or empty name means the served model (vLLM)."""
    names = model.config.served_model_names
    if name and name not in names:
        raise APIError(
            f"The model `{name}` does not exist; this server serves {', '.join(names)}",
            404,
            "model",
        )


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """OpenAI's bounds on `metadata`: at most 16 pairs, keys ≤ 64 characters, string values
    ≤ 512 characters."""
    if metadata is None:
        return
    allowed = (
        f"metadata takes at most {MAX_METADATA_PAIRS} pairs, with keys of at most "
        f"{MAX_METADATA_KEY_CHARS} characters and string values of at most "
        f"{MAX_METADATA_VALUE_CHARS} characters"
    )
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(f"{allowed}; got {len(metadata)} pairs", 400, "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise APIError(f"{allowed}; got a key of {len(key)} characters", 400, "metadata")
        if not isinstance(value, str):
            raise APIError(f"{allowed}; got a {type(value).__name__} value", 400, "metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(
                f"{allowed}; got a value of {len(value)} characters under {key[:64]!r}",
                400,
                "metadata",
            )


def check_capacity(model: ServedModel, num_requests: int, param: str) -> None:
    """503 unless `num_requests` engine requests (prompts × n) fit in the waiting queue."""
    client = model.client
    if not client.is_ready:
        reason = "starting or restarting" if client.is_accepting else "shutting down"
        raise service_unavailable(f"the model worker is not ready ({reason}); retry shortly")
    limit = model.config.max_waiting_requests
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
    if client.num_unstarted + num_requests > limit:
        raise service_unavailable(
            f"the server is busy: {client.num_unstarted} requests are waiting "
            f"(--max-waiting-requests {limit}); retry shortly"
        )


def check_prompt_chars(model: ServedModel, num_chars: int, param: str) -> None:
    """400 before tokenizing a text that cannot fit (or is over --max-prompt-chars)."""
    limit = model.max_prompt_chars
    if num_chars > limit:
        raise APIError(
            f"{param}: {num_chars} characters of text; this server takes at most {limit} "
            f"characters per prompt (--max-prompt-chars; by default what "
            f"{model.max_model_len} tokens of at most {model.max_token_chars} characters hold)",
            400,
            param,
        )


def check_prompt(model: ServedModel, prompt_token_ids: list[int], param: str) -> None:
    """A prompt the engine can run: not empty, shorter than the context, every id in vocab."""
    if not prompt_token_ids:
        raise APIError(f"{param} is empty; give at least one token of input", 400, param)
    num_prompt, max_model_len = len(prompt_token_ids), model.max_model_len
    if num_prompt >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your request has {num_prompt} input tokens. Please reduce the length of the "
            "input (at least one token must be left for the output).",
            400,
            param,
        )
    check_token_ids(model, prompt_token_ids, param)


def check_num_detokenized(model: ServedModel, num_token_ids: int, param: str) -> None:
    """/detokenize takes at most twice max_model_len ids: any sequence the model can hold, with
    room to spare (the answer's text grows with them, up to the longest token's length each)."""
    limit = DETOKENIZE_CONTEXTS * model.max_model_len
    if num_token_ids > limit:
        raise APIError(
            f"{param}: {num_token_ids} token ids; /detokenize takes at most {limit} per call "
            f"({DETOKENIZE_CONTEXTS} x max_model_len {model.max_model_len})",
            400,
            param,
        )


def check_token_ids(model: ServedModel, token_ids: list[int], param: str) -> None:
    """Every id in [0, the number of ids both the tokenizer and the model know)."""
    limit = model.num_token_ids
    bad = [t for t in token_ids if not 0 <= t < limit]
    if bad:
        raise APIError(
            f"token ids must be in [0, {limit}), got {bad[:5]} (out of vocabulary)", 400, param
        )


def num_logprob_entries(num_prompt: int, params: SamplingParams) -> int:
    """Logprob entries one prompt's choices may hold: per prompt token after the first and per
    token generated, its own entry and its top alternatives."""
    num_entries = 0
    if params.prompt_logprobs is not None:
        num_entries += params.n * (num_prompt - 1) * (params.prompt_logprobs + 1)
    if params.logprobs is not None:
        assert params.max_tokens is not None  # the front always sets it (max_tokens_for)
        num_entries += params.n * params.max_tokens * (params.logprobs + 1)
    return num_entries


def check_logprobs_size(prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Refuse a request whose logprobs could hold more than MAX_LOGPROB_ENTRIES."""
    num_entries = num_prompt_entries = 0
    for prompt, p in zip(prompts, params, strict=True):
        num_entries += num_logprob_entries(len(prompt), p)
        num_prompt_entries += num_logprob_entries(len(prompt), replace(p, logprobs=None))
    if num_entries > MAX_LOGPROB_ENTRIES:
        raise APIError(
            f"the logprobs of this request could hold {num_entries} entries (n x (prompt "
            "tokens x (prompt_logprobs + 1) + max_tokens x (logprobs + 1)), per prompt; echo "
            f"scores the prompt with logprobs); the limit is {MAX_LOGPROB_ENTRIES}: lower n, "
            "max_tokens, logprobs or prompt_logprobs, or send fewer or shorter prompts",
            400,
            "prompt_logprobs" if 2 * num_prompt_entries > num_entries else "logprobs",
        )
