"""A request as the engine sees it: token ids, counters and a block table."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from nanoserve.common.protocol import FinishReason, TokenLogprobs
from nanoserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from nanoserve.core.grammar import Grammar


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; only the scheduler moves it."""

    WAITING = 0  # queued; holds no blocks
    RUNNING = 1  # in the running batch; holds blocks
    PREEMPTED = 2  # was running, gave its blocks back, waits to be recomputed
    FINISHED = 3


class Request:
    """One sequence being generated.

    Counters, not flags: the scheduler only ever asks "how many of this request's tokens are
    not yet in the KV cache?" (`num_tokens - num_computed_tokens`). A fresh prompt, the next
    chunk of a long prompt, a prefix-cache hit and a decode step are all answered the same way.
    Only the scheduler changes the counters and the block table."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, kept together for speed
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache at admission
        self.block_ids: list[int] = []
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None  # the stop token id that ended it, if any
        self.generator: torch.Generator | None = None  # per-request RNG when seeded
        self.first_scheduled_time: float | None = None
        # With `prompt_logprobs`: how many prompt positions are scored, and the entries not yet
        # sent (position j's logprobs of prompt token j + 1); the first delta takes them.
        self.num_scored_prompt_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.grammar: Grammar | None = None  # structured output: advanced per token
        self.grammar_future: Future[Grammar] | None = None  # the grammar being built
        self.spec_token_ids: list[int] = []  # drafts proposed for the next step (unverified)

    def is_grammar_pending(self) -> bool:
        """True while the request's grammar is being built (it cannot run yet); once built, it
        moves into `grammar` (a grammar that failed to build raises ValueError)."""
        future = self.grammar_future
        if future is None:
            return False
        if not future.done():
            return True
        self.grammar_future = None
        self.grammar = future.result()
        return False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prompt_only(self) -> bool:
        """max_tokens == 0: run the prompt (e.g. to score it) and sample nothing."""
        return self.sampling_params.max_tokens == 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some prompt position's logprobs are asked for and not computed yet."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and self.num_scored_prompt_tokens < self.num_prompt_tokens - 1

    @property
    def max_cached_prefix_tokens(self) -> int:
        """How many leading tokens a prefix-cache hit may cover: never the last token (it must
        run to give the logits to sample from), nor a prompt position whose logprobs are still
        to be computed (only the rows that run give logits: it is recomputed, not read)."""
        if self.needs_prompt_logprobs:
            return self.num_scored_prompt_tokens
        return self.num_tokens - 1

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens}, blocks={self.block_ids})"
        )
