"""Continuous batching: decide, every step, how many tokens each request runs.

The scheduler's whole output is `{request: num_tokens}`. A new prompt, the next chunk of a long
prompt, a prompt whose prefix was cached and a decode step are the same thing: "run the next N
tokens of this request that are not in the KV cache yet" (vLLM v1's formulation).

Each step:
1. Running requests first, oldest first: one decode token, or the next prompt chunk. When the
   pool has no block for one of them, preempt the newest running request (free its blocks, put
   it back at the head of the waiting queue; it is recomputed later, mostly from the prefix
   cache) and retry.
2. Then waiting requests, in arrival order, while the token budget, `max_num_seqs` and free
   blocks allow. A step that had to preempt admits nobody new.

Invariant: a request scheduled in this step is never preempted in the same step (preemption
takes requests from the tail of `running`, behind the one being scheduled), so every block it
was given is written by this step's forward pass.

Speculative decoding adds nothing new: a decoding request with draft tokens runs 1 + k tokens
(budgeted like any others). `update` then advances `num_computed_tokens` only past the drafts
the verifier accepted; the slots of rejected ones are overwritten by later steps, and they are
never named in the prefix cache (only blocks full of known tokens are).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanoserve.common.config import SchedulerConfig
from nanoserve.common.protocol import FinishReason, RequestDelta, TokenLogprobs
from nanoserve.core.kv_cache_manager import KVCacheManager
from nanoserve.core.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to run in one step: tokens per request, in batch order."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # drafts included
    requests: list[Request] = field(default_factory=list)  # same order as the dict
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify
    preempted_ids: list[str] = field(default_factory=list)
    # Requests the engine could not run (their grammar failed to build), and why.
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.failed


class Scheduler:
    """Owns the waiting queue, the running batch and each request's counters."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    # -- intake ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: list[str]) -> None:
        """Finish requests in any state and return every block they held."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's work: running requests first, then waiting ones while there is room."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_ids:  # a step that had to preempt admits nobody new
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """One decode token or the next prompt chunk per running request; the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_tokens_to_run(request, budget)
            if num_new == 0:
                index += 1
                continue
            if not self._make_room(out, request, num_new):
                break  # it preempted itself; everyone behind it is gone too
            drafts = self._drafts_that_fit(request, num_new, budget)
            self.kv.allocate(request, num_new + len(drafts), [])
            self._record(out, request, num_new + len(drafts))
            if drafts:
                out.draft_token_ids[request.request_id] = drafts
            budget -= num_new + len(drafts)
            index += 1
        return budget

    def _drafts_that_fit(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts that the budget, max_model_len and free blocks allow (a
        decode step only); drafts never cause a preemption."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        room = min(budget - num_new, self.config.max_model_len - request.num_tokens)
        drafts = drafts[: max(room, 0)] if num_new == 1 else []
        if drafts and not self.kv.can_allocate(request, num_new + len(drafts), []):
            return []
        return drafts

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while the budget, max_num_seqs and blocks allow (a
        request whose grammar is still being built keeps its place and is passed over)."""
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._has_grammar_ready(out, request, passed_over):
                continue
            cached_blocks, num_cached = self.kv.find_cached_prefix(request)
            num_new = self._num_tokens_to_run(request, budget, num_cached)
            fits = self.kv.can_allocate(request, num_new, cached_blocks, num_cached)
            if num_new == 0 or not fits:
                break
            self.waiting.popleft()
            self.kv.allocate(request, num_new, cached_blocks, num_cached)
            request.num_computed_tokens = num_cached
            self.kv.record_prefix_lookup(request.num_tokens, num_cached)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            self._record(out, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))

    def _has_grammar_ready(
        self, out: SchedulerOutput, request: Request, passed_over: list[Request]
    ) -> bool:
        """False if `request` (the head of the queue) cannot run yet; it leaves the queue."""
        try:
            if not request.is_grammar_pending():
                return True
            passed_over.append(self.waiting.popleft())
        except ValueError as error:
            self.waiting.popleft()
            self._finish(request, FinishReason.ABORT)
            out.failed.append((request, str(error)))
        return False

    def _num_tokens_to_run(self, request: Request, budget: int, num_cached: int = 0) -> int:
        """Tokens not yet in the cache, cut to the budget (or 0 if it can't be chunked)."""
        num_new = request.num_tokens - request.num_computed_tokens - num_cached
        if num_new <= budget:
            return num_new
        return budget if self.config.enable_chunked_prefill else 0

    def _make_room(self, out: SchedulerOutput, request: Request, num_new: int) -> bool:
        """Preempt from the tail until `request` fits; False if it had to go itself."""
        while not self.kv.can_allocate(request, num_new, []):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _record(self, out: SchedulerOutput, request: Request, num_tokens: int) -> None:
        """Add `request` to this step's output with `num_tokens` to run."""
        out.num_scheduled_tokens[request.request_id] = num_tokens
        out.requests.append(request)

    def _preempt(self, request: Request) -> None:
        """Free the newest running request's blocks; it is recomputed when readmitted."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # -- update ---------------------------------------------------------------------------

    def update(
        self,
        out: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprobs]],
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> list[RequestDelta]:
        """Advance counters by what ran and was accepted, append sampled tokens (with drafts,
        the accepted ones and one more), finish requests that are done."""
        deltas = [
            RequestDelta(r.request_id, [], finish_reason=FinishReason.ABORT, error=message)
            for r, message in out.failed
        ]
        for request in out.requests:
            request_id = request.request_id
            token_ids = sampled_token_ids.get(request_id, [])
            num_drafts = len(out.draft_token_ids.get(request_id, ()))
            num_rejected = num_drafts + 1 - len(token_ids) if token_ids else 0
            request.num_computed_tokens += out.num_scheduled_tokens[request_id] - num_rejected
            scored = (prompt_logprobs or {}).get(request_id, [])
            request.prompt_logprobs += scored
            request.num_scored_prompt_tokens += len(scored)
            num_appended = 0
            for token_id in token_ids:
                request.append_output_token(token_id)
                num_appended += 1
                self._check_stop(request, token_id)
                if request.finish_reason is not None:
                    break
            if not token_ids:
                if not request.is_prompt_only or request.num_computed_tokens < request.num_tokens:
                    continue  # a prompt chunk that is not the last one: nothing sampled yet
                request.finish_reason = FinishReason.LENGTH  # the prompt ran; nothing to sample
            entries = logprobs.get(request_id)
            deltas.append(self._delta(request, num_appended, entries and entries[:num_appended]))
            if request.finish_reason is not None:
                self.running.remove(request)
                self._finish(request, request.finish_reason)
        return deltas

    @staticmethod
    def _delta(
        request: Request, num_new: int, token_logprobs: list[TokenLogprobs] | None
    ) -> RequestDelta:
        """This step's tokens of `request` (none when prompt-only); the first: prompt logprobs."""
        refused = request.grammar if request.finish_reason == FinishReason.ABORT else None
        is_first = request.num_output_tokens <= num_new  # prompt-only: one delta, empty
        prompt_logprobs = None
        if is_first and request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        queue_time_s = None  # arrival to first scheduled, on the first delta only
        if request.first_scheduled_time is not None:
            queue_time_s = request.first_scheduled_time - request.arrival_time
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=request.output_token_ids[len(request.output_token_ids) - num_new :],
            logprobs=token_logprobs or None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            queue_time_s=queue_time_s if is_first else None,
            prompt_logprobs=prompt_logprobs,
            error=(refused.error or "the grammar refused a token") if refused is not None else None,
        )

    def _check_stop(self, request: Request, token_id: int) -> None:
        params, grammar = request.sampling_params, request.grammar
        if grammar is not None and not grammar.accept(token_id):
            request.finish_reason = FinishReason.ABORT  # refused: an error, `_delta` says why
            return
        if grammar is not None and grammar.is_terminated:
            request.finish_reason = FinishReason.STOP  # nothing but EOS could follow
            return
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.finish_reason = FinishReason.STOP
                return
            if token_id in params.stop_token_ids:
                request.finish_reason = FinishReason.STOP
                request.stop_reason = token_id
                return
        if (
            params.max_tokens is not None
            and request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            request.finish_reason = FinishReason.LENGTH

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.grammar = None  # the matcher's memory goes with it
        if request.grammar_future is not None:
            request.grammar_future.cancel()
            request.grammar_future = None
        self.kv.free(request)
        self.kv.forget(request)
        del self.requests[request.request_id]
