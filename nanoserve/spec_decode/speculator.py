"""The speculator the engine is given: a proposer, the rejection sampler, and when to draft.

When to draft (speculation must never make a workload meaningfully slower):
- Only for a request that decodes (its prompt is in the cache) and has at least two tokens
  left to generate; a structured-output request's drafts are cut at the first token its
  grammar refuses (the grammar backend then masks each draft row at the state after the drafts
  before it, and rolls the grammar back).
- Not in a step where `disable_by_batch_size` requests (default 8) or more are decoding: a
  batch that large already fills the step with tokens, and verifying k + 1 tokens per request
  costs more than the accepted tokens save.
- As many drafts as are likely to pay: each request keeps an estimate of the chance that one
  more of its draft tokens is accepted (accepted drafts over accepted drafts plus rejections,
  decaying so that recent steps count most). The j-th draft is accepted with about that chance
  to the power j, and a verified token costs a share of a step (on a 2-core CPU a step of 4
  tokens of the 0.6B shape takes ~1.7x a one-token step), so a request drafts the tokens whose
  chance is at least `MIN_DRAFT_CHANCE` (0.3): all k at a chance of 0.9, one at 0.5.
- None for a request whose single next draft is below that chance: it pauses (16 steps,
  doubling each time it fails again, up to 512, until its drafts hold at 0.6 or better),
  then tries one draft again. A proposer that
  finds nothing to draft (no n-gram match) costs nothing.

Metrics (vLLM's spec_decode counters) and a log line every `LOG_INTERVAL_S` with the
acceptance rate and the mean acceptance length.
"""

from __future__ import annotations

import logging
import math
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
MIN_DRAFT_CHANCE = 0.3  # a draft token is worth verifying when it is this likely accepted
CHANCE_DECAY = 0.7  # the weight of a request's earlier steps in its acceptance estimate
FIRST_PAUSE_STEPS, MAX_PAUSE_STEPS = 16, 512
TRUSTED_DRAFT_CHANCE = 0.6  # a request whose drafts hold this well starts its pauses over
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

    num_accepted: float = 1.0  # decayed counts of its accepted drafts ...
    num_trials: float = 1.0  # ... and of those plus rejections: one draft chance at 1.0
    num_drafted: int = 0  # drafts given for the step in flight (0: none)
    num_output_before: int = 0  # its output length when they were given
    pause_steps: int = 0  # steps left without drafts
    next_pause: int = FIRST_PAUSE_STEPS

    @property
    def draft_chance(self) -> float:
        """The estimated chance that its next draft token is accepted."""
        return self.num_accepted / self.num_trials

    def num_worth_drafting(self, k: int) -> int:
        """The drafts whose chance of acceptance (chance^j for the j-th) is still worth it."""
        chance = self.draft_chance
        if chance >= 1.0:
            return k
        return min(k, int(math.log(MIN_DRAFT_CHANCE) / math.log(max(chance, 1e-6)) + 1e-9))

    def learn(self, num_accepted: int, num_drafted: int) -> None:
        """One verify step: `num_accepted` of `num_drafted` drafts held."""
        rejected = 1 if num_accepted < num_drafted else 0
        self.num_accepted = CHANCE_DECAY * self.num_accepted + num_accepted
        self.num_trials = CHANCE_DECAY * self.num_trials + num_accepted + rejected
        if self.draft_chance >= MIN_DRAFT_CHANCE:
            if self.draft_chance >= TRUSTED_DRAFT_CHANCE:
                self.next_pause = FIRST_PAUSE_STEPS
            return
        self.pause_steps = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
        self.num_accepted = self.num_trials = 1.0  # after the pause, a fresh start
        self.num_accepted = MIN_DRAFT_CHANCE  # ... at one draft


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
            if request.grammar is not None:  # only what the grammar accepts is drafted
                drafts = drafts[: request.grammar.count_valid(drafts)]
            request.spec_token_ids = drafts
            history = self.histories[request.request_id][1]
            history.num_drafted = len(drafts)
            history.num_output_before = request.num_output_tokens

    def _draft_limit(self, request: Request) -> int:
        """How many tokens `request` may have drafted for its next step (0: none)."""
        params = request.sampling_params
        if request.grammar_future is not None:
            return 0  # its grammar is still being built
        _, history = self.histories.setdefault(request.request_id, (request, DraftHistory()))
        if history.pause_steps > 0:
            history.pause_steps -= 1
            return 0
        limit = history.num_worth_drafting(self.num_speculative_tokens)
        if params.max_tokens is None:
            return limit
        return min(limit, params.max_tokens - request.num_output_tokens - 1)

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
            history.learn(min(num_new - 1, drafted), drafted)

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
