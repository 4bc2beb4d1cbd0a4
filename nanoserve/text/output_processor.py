"""From engine deltas to results: one path for the offline `LLM` and the server alike.

The engine knows token ids only. Everything between its deltas and an API result happens here,
once, as in vLLM v1's output processor:

- fan-out: a prompt asking for `n` choices becomes n engine requests `{id}-{i}`; a seeded one
  gives choice i the seed + i, so the choices differ but each is reproducible;
- one `IncrementalDetokenizer` per choice turns its tokens into text and finds stop strings; a
  stop string ends the choice here, and the caller aborts it in the engine (`needs_abort`);
- finish reasons become their API names ("stop", "length", "abort");
- logprobs, of generated and of prompt tokens, get the text of every token they name
  (`PositionLogprobs`); a choice's prompt logprobs start with None for the first prompt token.

The caller feeds it deltas (`process`) and reads `ChoiceUpdate`s: what each delta added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from nanoserve.common.protocol import FinishReason, RequestDelta, TokenLogprobs
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.text.tokenizer import IncrementalDetokenizer

TOKEN_TEXT_CACHE_SIZE = 65536


@dataclass(frozen=True)
class EngineRequest:
    """One engine request: what `Engine.add_request` (or the worker) receives."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class PositionLogprobs:
    """The chosen token at one position, its log-probability and rank, and the top others."""

    token_id: int
    token: str
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, str, float]]  # (token id, text, logprob), most likely first


@dataclass
class ChoiceState:
    """One choice being generated (one engine request): its tokens, text and ending."""

    index: int  # the choice's index in the API response
    prompt_index: int  # which prompt of the request it continues
    request_id: str
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool
    wants_prompt_logprobs: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # One per prompt token, None for the first; None until the first delta brings them.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChoiceUpdate:
    """What one engine delta added to a choice."""

    choice: ChoiceState
    text: str  # new text that is safe to show
    token_ids: list[int]  # the delta's tokens
    logprobs: list[PositionLogprobs]  # one per token, when asked for
    is_first: bool  # the choice's first tokens
    needs_abort: bool  # a stop string ended it; the engine is still generating it


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of `params`: n = 1, and a seeded request's seed + index."""
    if params.n == 1 and params.seed is None:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


class OutputProcessor:
    """The choices of one batch of requests (an `LLM.generate` call, or one API request)."""

    def __init__(self, tokenizer, token_text: Callable[[int], str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.choices: dict[str, ChoiceState] = {}  # engine request id -> its choice
        self.token_text = token_text or lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)(
            lambda token_id: tokenizer.decode([token_id])
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_index: int = 0,
    ) -> list[EngineRequest]:
        """Fan one prompt out into its n choices; returns the engine requests to add."""
        engine_requests = []
        first_index = prompt_index * params.n
        for i in range(params.n):
            index = first_index + i
            child = child_params(params, i)
            child_id = f"{request_id}-{index}"
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child)
            self.choices[child_id] = ChoiceState(
                index=index,
                prompt_index=prompt_index,
                request_id=child_id,
                prompt_token_ids=prompt_token_ids,
                detokenizer=detokenizer,
                wants_logprobs=child.logprobs is not None,
                wants_prompt_logprobs=child.prompt_logprobs is not None,
            )
            engine_requests.append(EngineRequest(child_id, prompt_token_ids, child))
        return engine_requests

    @property
    def num_unfinished(self) -> int:
        return sum(not c.is_finished for c in self.choices.values())

    def unfinished_request_ids(self) -> list[str]:
        return [request_id for request_id, c in self.choices.items() if not c.is_finished]

    def process(self, delta: RequestDelta) -> ChoiceUpdate | None:
        """Apply one delta; None if its choice had already finished (e.g. at a stop string)."""
        choice = self.choices[delta.request_id]
        if choice.is_finished:
            return None
        is_first = not choice.token_ids
        if is_first:
            choice.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = [None, *map(self.decode_logprobs, delta.prompt_logprobs)]
        text, new_token_ids = self._detokenize(choice, delta.new_token_ids)
        choice.token_ids.extend(new_token_ids)
        entries = (delta.logprobs or [])[: len(new_token_ids)]
        logprobs = [self.decode_logprobs(entry) for entry in entries]
        choice.logprobs.extend(logprobs)
        needs_abort = False
        if choice.detokenizer.stop_reason is not None:
            choice.finish_reason, choice.stop_reason = "stop", choice.detokenizer.stop_reason
            needs_abort = delta.finish_reason is None
        elif delta.finish_reason is not None:
            text += choice.detokenizer.flush()
            choice.finish_reason = str(FinishReason(delta.finish_reason))
            choice.stop_reason = delta.stop_reason
        choice.text += text
        return ChoiceUpdate(choice, text, new_token_ids, logprobs, is_first, needs_abort)

    @staticmethod
    def _detokenize(choice: ChoiceState, token_ids: list[int]) -> tuple[str, list[int]]:
        """The text of a delta's tokens, and the tokens the choice keeps: with stop strings,
        a delta of several tokens (speculative decoding, or a reader behind) is read token
        by token and ends at the one that completes a stop string, as one token at a time
        would have."""
        detokenizer = choice.detokenizer
        if len(token_ids) <= 1 or not detokenizer.has_stop_strings:
            return detokenizer.update(token_ids), list(token_ids)
        text = ""
        for count, token_id in enumerate(token_ids, start=1):
            text += detokenizer.update([token_id])
            if detokenizer.stop_reason is not None:
                return text, list(token_ids[:count])
        return text, list(token_ids)

    def decode_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        """The engine's logprobs of one position, with the text of every token named."""
        top = [
            (token_id, self.token_text(token_id), logprob)
            for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
        ]
        return PositionLogprobs(
            entry.token_id, self.token_text(entry.token_id), entry.logprob, entry.rank, top
        )

    def sorted_choices(self) -> list[ChoiceState]:
        """Every choice, in response order."""
        return sorted(self.choices.values(), key=lambda c: c.index)
