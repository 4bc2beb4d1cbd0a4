"""Logprobs in the API's shapes: the legacy completions lists, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nanoserve.server.openai.api_models import CompletionLogprobs, PromptLogprob, PromptLogprobs
from nanoserve.text.output_processor import ChoiceState, PositionLogprobs


def append_completion_logprobs(
    result: CompletionLogprobs,
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    text_offset: int,
    token_text: Callable[[int], str],
) -> None:
    """Add tokens to the legacy lists; their text offsets count on from `text_offset`.

    A position without logprobs (the first prompt token) is listed with null logprob and
    top_logprobs, as OpenAI and vLLM do.
    """
    for token_id, position in zip(token_ids, positions, strict=True):
        if position is None:
            token = token_text(token_id)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            token = position.token
            top: dict[str, float] = {}
            for _, top_token, logprob in position.top:
                # Best first; tokens whose text is the same (e.g. partial bytes) keep the best.
                top.setdefault(top_token, logprob)
            top.setdefault(token, position.logprob)
            result.token_logprobs.append(position.logprob)
            result.top_logprobs.append(top)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)


def prompt_positions(choice: ChoiceState) -> list[PositionLogprobs | None]:
    """The choice's prompt logprobs, one per prompt token (all None if none were computed)."""
    return choice.prompt_logprobs or [None] * len(choice.prompt_token_ids)


def vllm_prompt_logprobs(choice: ChoiceState) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per prompt token, token id -> logprob, rank and text."""
    if choice.prompt_logprobs is None:
        return None
    return [None if p is None else _logprob_entries(p) for p in choice.prompt_logprobs]


def _logprob_entries(position: PositionLogprobs) -> dict[int, PromptLogprob]:
    """The position's own token first, then the top alternatives (best first)."""
    entries = {
        position.token_id: PromptLogprob(
            logprob=position.logprob, rank=position.rank, decoded_token=position.token
        )
    }
    for rank, (token_id, token, logprob) in enumerate(position.top, start=1):
        entries.setdefault(token_id, PromptLogprob(logprob=logprob, rank=rank, decoded_token=token))
    return entries
