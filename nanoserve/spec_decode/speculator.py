"""The speculator the engine is given: a proposer, the rejection sampler, and when to draft.

When to draft (speculation must never make a workload meaningfully slower):
- Only for a request that decodes (its prompt is in the cache), has no grammar (a draft would
  need the grammar advanced and rolled back per position; constrained requests decode plainly),
  and has at least two tokens left to generate.
- Not in a step where `disable_by_batch_size` requests (default 8) or more are decoding: a
  batch that large already fills the step with tokens, and verifying k + 1 tokens per request
  costs more than the accepted tokens save.
- Not for a request whose drafts keep failing: each request keeps a running acceptance rate
  (the share of drafted tokens accepted, an exponential average); below `MIN_ACCEPTANCE` it
  stops drafting for a while (8 steps, doubling each time it fails again, up to 256), then
  tries again. A proposer that finds nothing to draft (no n-gram match) costs nothing.

Metrics (vLLM's spec_decode counters) and a log line every `LOG_INTERVAL_S` with the
acceptance rate and the mean acceptance length.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoserve.common.protocol import SpecDecodeStats
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.request import Request
from nanoserve.core.sampling_batch import SamplingBatch
from nanoserve.core.speculation import Speculator, Verified
from nanoserve.spec_decode.rejection_sampler import RejectionSampler

logger = logging.getLogger("nanoserve.spec_decode")

DEFAULT_DISABLE_BY_BATCH_SIZE = 8
MIN_ACCEPTANCE = 0.25  # below this running acceptance rate a request pauses drafting
FIRST_PAUSE_STEPS, MAX_PAUSE_STEPS = 8, 256
LOG_INTERVAL_S = 10.0


class Proposer(Protocol):
    """Drafts tokens for a batch of requests."""

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """At most `num_tokens[i]` draft tokens for `requests[i]` (maybe none)."""
        ...

    def finish(self, request: Request) -> None:
        """`request` finished: drop what the proposer kept for it."""

    def close(self) -> None: ...


@dataclass
class DraftHistory:
    """One request's record of drafting: how well its drafts fared, and any pause."""

    acceptance: float = 1.0  # running share of drafted tokens accepted
    num_drafted: int = 0  # drafts given for the step in flight (0: none)
    num_output_before: int = 0  # its output length when they were given
    pause_steps: int = 0  # steps left without drafts
    next_pause: int = FIRST_PAUSE_STEPS


class AdaptiveSpeculator(Speculator):
    """Implements the core's `Speculator`: drafts where they pay, verifies, counts."""

    def __init__(self, proposer: Proposer, config: SpeculativeConfig) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        self.rejection_sampler = RejectionSampler()
        self.histories: dict[str, tuple[Request, DraftHistory]] = {}
        self.totals = SpecDecodeStats(num_accepted_per_position=[0] * config.num_speculative_tokens)
        self._logged = (time.monotonic(), SpecDecodeStats())

    def propose(self, requests: list[Request]) -> None:
        self._learn_from_last_step()
        decoding = [r for r in requests if r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) >= self.disable_by_batch_size:
            return
        chosen, limits = [], []
        for request in decoding:
            limit = self._draft_limit(request)
            if limit > 0:
                chosen.append(request)
                limits.append(limit)
        if not chosen:
            return
        for request, drafts in zip(chosen, self.proposer.propose(chosen, limits), strict=True):
            request.spec_token_ids = drafts
            history = self.histories[request.request_id][1]
            history.num_drafted = len(drafts)
            history.num_output_before = request.num_output_tokens

    def _draft_limit(self, request: Request) -> int:
        """How many tokens `request` may have drafted for its next step (0: none)."""
        params = request.sampling_params
        if request.grammar is not None or request.grammar_future is not None:
            return 0
        _, history = self.histories.setdefault(request.request_id, (request, DraftHistory()))
        if history.pause_steps > 0:
            history.pause_steps -= 1
            return 0
        if params.max_tokens is None:
            return self.num_speculative_tokens
        return min(self.num_speculative_tokens, params.max_tokens - request.num_output_tokens - 1)

    def _learn_from_last_step(self) -> None:
        """Update each drafting request's acceptance; forget finished requests."""
        for request_id, (request, history) in list(self.histories.items()):
            if request.is_finished:
                del self.histories[request_id]
                self.proposer.finish(request)
                continue
            if history.num_drafted == 0:
                continue
            num_new = request.num_output_tokens - history.num_output_before
            drafted, history.num_drafted = history.num_drafted, 0
            if num_new == 0:
                continue  # not scheduled (or preempted): its drafts were dropped
            rate = min(num_new - 1, drafted) / drafted
            history.acceptance = 0.5 * history.acceptance + 0.5 * rate
            if history.acceptance < MIN_ACCEPTANCE:
                history.pause_steps = history.next_pause
                history.next_pause = min(2 * history.next_pause, MAX_PAUSE_STEPS)
                history.acceptance = MIN_ACCEPTANCE  # on resuming, one good step keeps it on
            elif rate >= MIN_ACCEPTANCE:
                history.next_pause = FIRST_PAUSE_STEPS

    def verify(
        self, logits: torch.Tensor, batch: SamplingBatch, draft_token_ids: list[list[int]]
    ) -> Verified:
        verified = self.rejection_sampler(logits, batch, draft_token_ids)
        totals = self.totals
        for drafts, num_accepted in zip(
            draft_token_ids, self.rejection_sampler.num_accepted, strict=True
        ):
            if drafts:
                totals.num_drafts += 1
                totals.num_draft_tokens += len(drafts)
                totals.num_accepted_tokens += num_accepted
                for position in range(num_accepted):
                    totals.num_accepted_per_position[position] += 1
        self._log_now_and_then()
        return verified

    def _log_now_and_then(self) -> None:
        """vLLM's SpecDecoding log line, over the drafts since the last one."""
        now = time.monotonic()
        last_time, last = self._logged
        if now - last_time < LOG_INTERVAL_S:
            return
        totals = self.totals
        num_drafts = totals.num_drafts - last.num_drafts
        drafted = totals.num_draft_tokens - last.num_draft_tokens
        accepted = totals.num_accepted_tokens - last.num_accepted_tokens
        if num_drafts:
            logger.info(
                "SpecDecoding metrics: mean acceptance length: %.2f, accepted: %d tokens, "
                "drafted: %d tokens, draft acceptance rate: %.1f%%",
                1 + accepted / num_drafts,
                accepted,
                drafted,
                100 * accepted / max(drafted, 1),
            )
        snapshot = SpecDecodeStats(
            totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens
        )
        self._logged = (now, snapshot)

    def stats(self) -> SpecDecodeStats:
        totals = self.totals
        return SpecDecodeStats(
            totals.num_drafts,
            totals.num_draft_tokens,
            totals.num_accepted_tokens,
            list(totals.num_accepted_per_position),
        )

    def close(self) -> None:
        self.proposer.close()
