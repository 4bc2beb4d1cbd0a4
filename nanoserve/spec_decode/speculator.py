"""The speculator the engine is given: a proposer, the rejection sampler, and when to draft.

When to draft (speculation must never make a workload meaningfully slower):
- Only for a request that decodes (its prompt is in the cache) and has at least two tokens
  left to generate; a structured-output request's drafts are cut at the first token its
  grammar refuses (the grammar backend then masks each draft row at the state after the drafts
  before it, and rolls the grammar back).
- Not in a step where `disable_by_batch_size` requests (default 8) or more are decoding: a
  batch that large already fills the step with tokens.
- As many drafts as make the step pay most, by what steps cost on this machine. Each request
  keeps, per draft position, an estimate of the chance that its draft there is accepted if
  the ones before it are (decaying, so that recent steps count most); their product up to
  position j is the chance its j-th draft holds, the tokens that draft adds. `StepCosts`
  (`step_costs.py`) times the engine's own steps and says what a step verifying D drafts
  costs, in plain steps of the same requests: cost(D). Of all the draft counts, the step
  takes the one with the most expected tokens per second, (B + the D likeliest drafts'
  chances) / cost(D) for B decoding requests, and none unless that beats a plain step (B / 1).
  So the j-th draft of a lone request is made only while its chance exceeds what one more
  draft costs, cost(j) - cost(j - 1), times the tokens per step already planned; and the
  first draft also pays for everything a verify step costs beyond a plain one (a draft
  model's own steps included) since, if rejected, the step still gives one token. Cheap
  verify steps: more drafts; dear ones: fewer, or none.
- The first steps at each batch size are plain, to time them (and again once those times
  are stale).
- A request given no drafts pauses (4 steps, doubling each time up to 512, back to 4 once
  it drafts by the rule above), then tries one draft whatever it costs: its chance starts over
  from `FRESH_CHANCE`, so a hit (~0.7) brings its drafts back and a miss pauses it longer.
  Trials fall on steps whose number is a multiple of `PEEK_EVERY` (a pause runs up to 3 steps
  longer), as peeks do (below): a batch's paused requests try and peek in the same steps,
  which share one verify step's cost, and the steps between are quiet.
- A proposer that can tell a draft it is sure of (`can_peek`: suffix decoding, whose drafts are
  as long as their match and as their continuation stays likely; n-gram, whose `peek` drafts
  only after a match of the longest n-gram it tries, where short ones recur in any text) is
  asked about a paused request (`peek`): a draft of `LONG_DRAFT` tokens or more (or as many
  as the request has room for: the request repeats a passage that it or an earlier request
  wrote, whose first draft holds ~9 times in 10 where a one-token draft holds ~1 in 4) ends
  the pause, and is verified whole. It is asked every `PEEK_EVERY` steps at first (those whose
  number is a multiple of it), then half as often, down to every `MAX_PEEK_EVERY` steps, after
  each short draft no longer than the one before (a request that repeats nothing costs a
  lookup every 32 steps, not every 4; one that has begun to repeat a passage is offered longer
  drafts each time, its match growing, and keeps being asked often). Beside other decoding
  requests such a request pauses `MAX_PAUSE_STEPS` before its trial (a trial makes their step
  a verify step too); alone it tries after its pause as any other. Long drafts that ended a
  pause and failed at once, twice in a row, make the next pause's peeks start half as often
  (and so on, down to every `MAX_PEEK_EVERY` steps) until drafting pays again: such drafts,
  failing every time beside another request, had made every fourth step a verify step.
- Steps in which no request can draft (every one paused, none due a peek or a trial) cost a
  comparison: the speculator counts their pauses down ahead and returns at once while the
  same requests run (a `QuietSpell`; a small model's step is well under a millisecond, and the
  bookkeeping of a paused step was a few percent of it).
- A request for which the proposer finds nothing (no n-gram match) is asked again at once, but
  where a proposer call costs `DEAR_LOOKUP` (1%) of a plain step or more (timed, as the steps
  are), after 1, 3, 7 and then 15 steps while it keeps finding nothing.

Metrics (vLLM's spec_decode counters) and a log line every `LOG_INTERVAL_S` with the
acceptance rate and the mean acceptance length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nanoserve.common.protocol import SpecDecodeStats
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.request import Request
from nanoserve.core.sampling_batch import SamplingBatch
from nanoserve.core.speculation import Speculator, Verified
from nanoserve.spec_decode.rejection_sampler import RejectionSampler
from nanoserve.spec_decode.step_costs import StepCosts

logger = logging.getLogger("nanoserve.spec_decode")

DEFAULT_DISABLE_BY_BATCH_SIZE = 8
CHANCE_DECAY = 0.7  # the weight of a request's earlier steps in its acceptance estimate
FIRST_PAUSE_STEPS, MAX_PAUSE_STEPS = 4, 512
MAX_EMPTY_WAIT_STEPS = 15  # the longest wait after the proposer found nothing to draft
DEAR_LOOKUP = 0.01  # a proposer call costing this share of a plain step is worth sparing
FRESH_CHANCE = 0.3  # the estimate a request's trial draft starts from after a pause
PEEK_EVERY = 4  # a paused request's steps between asks, where drafts' lengths tell
MAX_PEEK_EVERY = 32  # ... doubling up to this while its drafts stay short and do not grow
LONG_DRAFT = 6  # a draft this long, asked for during a pause, ends the pause
LOG_INTERVAL_S = 10.0


class Proposer(Protocol):
    """Drafts tokens for a batch of requests."""

    # Whether `peek` can tell a draft it is sure of: then a long one ends a pause (see above).
    can_peek: bool

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """At most `num_tokens[i]` draft tokens for `requests[i]` (maybe none)."""
        ...

    def peek(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """As `propose`, but only drafts it is sure of, as long as it is sure (paused requests
        are asked: a long draft ends a pause). Only where `can_peek`."""
        ...

    def finish(self, request: Request) -> None:
        """`request` finished: drop what the proposer kept for it."""

    def close(self) -> None: ...


@dataclass
class DraftHistory:
    """One request's record of drafting: how well its drafts fared by position, and any pause.

    Per draft position j, decayed counts of the steps whose drafts reached it (every draft
    before it accepted) and of those that accepted it: their ratio (past the first, drawn
    towards position j - 1's) is the chance that its j-th draft holds if the ones before do.
    Positions differ: a copied passage's first draft may miss where the rest, once it hits,
    rarely do.
    """

    accepted: list[float] = field(default_factory=lambda: [1.0])  # by position: one
    reached: list[float] = field(default_factory=lambda: [1.0])  # draft chance at 1.0
    num_drafted: int = 0  # drafts given for the step in flight (0: none)
    num_output_before: int = 0  # its output length when they were given
    pause_steps: int = 0  # steps left without drafts
    next_pause: int = FIRST_PAUSE_STEPS
    is_trial_due: bool = False  # after its pause: one draft, whatever it costs
    is_peeking: bool = False  # paused by the plan, its proposer able to peek (not waiting
    # after empty lookups)
    peek_every: int = PEEK_EVERY  # while peeking: steps from one ask to the next
    first_peek_every: int = PEEK_EVERY  # ... at the start of its next pause
    is_peek_draft_in_flight: bool = False  # its drafts in flight ended a pause
    num_failed_peek_drafts: int = 0  # such drafts in a row that failed at once
    last_peek_drafts: int = 0  # the length of the draft its last peek was offered
    empty_wait_steps: int = 0  # the wait after the proposer next finds nothing to draft

    @property
    def draft_chance(self) -> float:
        """The estimated chance that its next first draft token is accepted."""
        return self.acceptance(1)[0]

    def acceptance(self, num_drafts: int) -> list[float]:
        """[num_drafts]: the chance that each of its next drafts is accepted (and all before)."""
        conditional = self.accepted[0] / self.reached[0]
        chances, chance = [], 1.0
        for position in range(num_drafts):
            if 0 < position < len(self.reached):  # one reached seldom keeps near the last
                reached = self.reached[position]
                conditional = (self.accepted[position] + conditional) / (reached + 1.0)
            chance *= conditional
            chances.append(chance)
        return chances

    def learn(self, num_accepted: int, num_drafted: int) -> None:
        """One verify step: the first `num_accepted` of its `num_drafted` drafts held."""
        if self.is_peek_draft_in_flight:
            self._peek_draft_verified(num_accepted)
        num_reached = min(num_accepted + 1, num_drafted)
        while len(self.reached) < num_reached:
            self.accepted.append(0.0)
            self.reached.append(0.0)
        for position in range(len(self.reached)):
            self.accepted[position] *= CHANCE_DECAY
            self.reached[position] *= CHANCE_DECAY
            if position < num_reached:
                self.reached[position] += 1.0
                self.accepted[position] += 1.0 if position < num_accepted else 0.0

    def _peek_draft_verified(self, num_accepted: int) -> None:
        """Drafts that ended a pause and failed at once (none held) for the second time in a
        row make its next pause peek half as often from its start, down to every
        `MAX_PEEK_EVERY` steps: long drafts that keep failing would otherwise make every fourth
        step a verify step (one failure is left alone: an edit's drafts miss once where it
        diverges)."""
        self.is_peek_draft_in_flight = False
        self.num_failed_peek_drafts = 0 if num_accepted else self.num_failed_peek_drafts + 1
        if self.num_failed_peek_drafts >= 2:
            self.first_peek_every = min(2 * self.peek_every, MAX_PEEK_EVERY)

    def pause(self, step_index: int, can_peek: bool, is_alone: bool) -> None:
        """No drafts for a while (this step, number `step_index`, the first), then a trial from
        a fresh estimate, on a step whose number is a multiple of `PEEK_EVERY` (as peeks are:
        a batch's requests try and peek in the same steps, and skip the ones between). One
        that `can_peek` beside other requests (not `is_alone`) pauses `MAX_PAUSE_STEPS`: its
        trial would turn their shared step into a verify step, and its peeks end the pause
        sooner."""
        waits_for_peeks = can_peek and not is_alone
        steps = (MAX_PAUSE_STEPS if waits_for_peeks else self.next_pause) - 1
        self.pause_steps = steps + -(step_index + steps + 1) % PEEK_EVERY
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
        self.accepted, self.reached = [FRESH_CHANCE], [1.0]
        self.is_trial_due, self.is_peeking = True, can_peek
        self.peek_every, self.last_peek_drafts = self.first_peek_every, 0

    def is_peek_due(self, step_index: int) -> bool:
        """Whether step number `step_index` of its pause is one to ask the proposer in."""
        return self.is_peeking and step_index % self.peek_every == 0

    def peeked_in_vain(self, num_drafts: int) -> None:
        """The proposer's draft was short (`num_drafts` tokens): unless it grew since the last
        peek (a match lengthening as the request repeats a passage), ask half as often, down
        to every `MAX_PEEK_EVERY` steps (its asks still fall on steps that the more frequent
        ones share)."""
        grew, self.last_peek_drafts = num_drafts > self.last_peek_drafts, num_drafts
        if not grew:
            self.peek_every = min(2 * self.peek_every, MAX_PEEK_EVERY)

    def steps_without_news(self, step_index: int) -> int:
        """The steps after step number `step_index` in which it surely neither drafts nor
        peeks."""
        if self.is_peeking:
            return min(self.pause_steps, self.peek_every - 1 - step_index % self.peek_every)
        return self.pause_steps

    def end_pause(self) -> None:
        """A long draft came up while paused: draft again now (see `learn` if it fails)."""
        self.pause_steps = 0
        self.is_trial_due = self.is_peeking = False
        self.is_peek_draft_in_flight = True

    def drafts_pay(self) -> None:
        """The plan gave it drafts on their merits: short pauses and frequent peeks again."""
        self.next_pause, self.first_peek_every = FIRST_PAUSE_STEPS, PEEK_EVERY
        self.num_failed_peek_drafts = 0

    def found(self, num_drafts: int, is_lookup_dear: bool) -> None:
        """The proposer gave `num_drafts` drafts; none again and again, where asking it costs
        a share of a step worth sparing: ask less often (0, 1, 3, 7 ... steps later)."""
        if num_drafts:
            self.empty_wait_steps, self.is_trial_due, self.is_peeking = 0, False, False
            return
        if not is_lookup_dear:
            return
        self.pause_steps = max(self.pause_steps, self.empty_wait_steps)
        self.is_peeking = False
        self.empty_wait_steps = min(2 * self.empty_wait_steps + 1, MAX_EMPTY_WAIT_STEPS)


def plan_drafts(acceptance: list[list[float]], costs: list[float], num_requests: int) -> list[int]:
    """Drafts per request: the counts with the most expected tokens per second in a step of
    `num_requests` decoding requests. `acceptance[i]`: the chance that each draft request i
    may have is accepted (non-increasing); `costs[D]`: verifying D drafts in all, in plain
    steps."""
    gains = sorted(  # likeliest first; each request's in order (ties: chance 1.0)
        (
            (chance, -position, -index)
            for index, chances in enumerate(acceptance)
            for position, chance in enumerate(chances)
        ),
        reverse=True,
    )
    best_rate, best_num_drafts = float(num_requests), 0  # a plain step: B tokens, cost 1
    expected = float(num_requests)
    for num_drafts, (gain, _, _) in enumerate(gains[: len(costs) - 1], start=1):
        expected += gain
        if expected / costs[num_drafts] > best_rate:
            best_rate, best_num_drafts = expected / costs[num_drafts], num_drafts
    counts = [0] * len(acceptance)
    for _, _, negative_index in gains[:best_num_drafts]:
        counts[-negative_index] += 1
    return counts


@dataclass
class StepInFlight:
    """The step the last `propose` set up, to time it: when, which requests, how many drafts."""

    started_s: float
    num_output_tokens: dict[str, int]  # per decoding request, its output length then
    num_drafts: int
    is_decode_only: bool  # every running request was decoding


@dataclass
class QuietSpell:
    """Steps in which no request can draft: `propose` skips them while the same `requests`
    run. Their histories' pauses were counted down by `num_steps` when it began."""

    requests: list[Request]
    histories: list[DraftHistory]
    num_steps: int  # steps left to skip
    last_s: float | None = None  # when the last skipped step began

    def holds_for(self, requests: list[Request]) -> bool:
        return (
            self.num_steps > 0
            and len(requests) == len(self.requests)
            and all(a is b for a, b in zip(requests, self.requests, strict=True))
        )


class AdaptiveSpeculator(Speculator):
    """Implements the core's `Speculator`: drafts where they pay, verifies, counts."""

    def __init__(
        self,
        proposer: Proposer,
        config: SpeculativeConfig,
        costs: StepCosts | None = None,
        clock: Callable[[], float] = time.perf_counter,
        rejection_sampler: RejectionSampler | None = None,
    ) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        self.costs = costs or StepCosts()
        self.clock = clock
        self.rejection_sampler = rejection_sampler or RejectionSampler()
        self.histories: dict[str, tuple[Request, DraftHistory]] = {}
        self.in_flight: StepInFlight | None = None
        self.quiet: QuietSpell | None = None
        self.step_index = 0  # steps proposed for (the clock of pauses and peeks)
        self.totals = SpecDecodeStats(num_accepted_per_position=[0] * config.num_speculative_tokens)
        self._logged = (time.monotonic(), SpecDecodeStats())

    def propose(self, requests: list[Request]) -> None:
        now_s = self.clock()
        self.step_index += 1
        if self.quiet is not None and self._stays_quiet(requests, now_s):
            return
        self._learn_from_last_step()
        decoding = [r for r in requests if r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) >= self.disable_by_batch_size:
            self.in_flight = None  # a batch this large is given no drafts, so is not timed
            return
        self._time_last_step(requests, now_s)
        num_drafts = 0
        if not self.costs.needs_plain_step(len(decoding)):
            num_drafts = self._draft(decoding)
        self.in_flight = StepInFlight(
            now_s,
            {r.request_id: r.num_output_tokens for r in decoding},
            num_drafts,
            len(decoding) == len(requests),
        )
        if num_drafts == 0 and len(decoding) == len(requests):
            self._begin_quiet(requests)

    def _begin_quiet(self, requests: list[Request]) -> None:
        """Skip the coming steps in which none of these (decoding, given no drafts) can draft."""
        pairs = [self.histories.get(r.request_id) for r in requests]
        if not requests or None in pairs:
            return  # (a request not yet seen by `_draft`: a plain step to time)
        histories = [pair[1] for pair in pairs if pair is not None]
        num_steps = min(h.steps_without_news(self.step_index) for h in histories)
        if num_steps > 0:
            for history in histories:
                history.pause_steps -= num_steps
            self.quiet = QuietSpell(list(requests), histories, num_steps)

    def _stays_quiet(self, requests: list[Request], now_s: float) -> bool:
        """Whether this step is one of the quiet spell's; if the requests changed, the steps
        it did not skip are its requests' pauses again."""
        spell = self.quiet
        assert spell is not None
        if spell.holds_for(requests):
            # Its steps are plain steps of the same requests, timed from one skip to the next
            # (not the step that began it: that one's `propose` was a full one).
            spell.num_steps -= 1
            if spell.last_s is not None:
                self.costs.observe(len(requests), 0, now_s - spell.last_s)
            spell.last_s = now_s
            self.in_flight = None
            if spell.num_steps == 0:  # its last step, timed by the next `propose`
                outputs = {r.request_id: r.num_output_tokens for r in requests}
                self.in_flight = StepInFlight(now_s, outputs, 0, True)
            return True
        for history in spell.histories:
            history.pause_steps += spell.num_steps
        self.quiet = None
        return False

    def _draft(self, decoding: list[Request]) -> int:
        """Give the decoding requests the drafts that pay (see above); how many in all."""
        limits = [self._draft_limit(r) for r in decoding]
        num_drafts = self._peek(decoding, limits)
        if not any(limits):
            return num_drafts
        histories = [self.histories[r.request_id][1] for r in decoding]
        is_trial = [h.is_trial_due and n > 0 for h, n in zip(histories, limits, strict=True)]
        planned = plan_drafts(
            [
                h.acceptance(0 if trial else n)
                for h, trial, n in zip(histories, is_trial, limits, strict=True)
            ],
            self.costs.relative_costs(len(decoding), sum(limits)),
            len(decoding),
        )
        chosen, counts = [], []
        for request, history, limit, trial, count in zip(
            decoding, histories, limits, is_trial, planned, strict=True
        ):
            if trial or count > 0:
                chosen.append(request)
                counts.append(1 if trial else count)
                if not trial:
                    history.drafts_pay()
            elif limit > 0:
                history.pause(self.step_index, self.proposer.can_peek, len(decoding) == 1)
        return num_drafts + (self._give_drafts(chosen, counts) if chosen else 0)

    def _give_drafts(self, requests: list[Request], counts: list[int]) -> int:
        """Ask the proposer for up to `counts[i]` drafts of `requests[i]`; how many it gave."""
        started_s = self.clock()
        proposed = self.proposer.propose(requests, counts)
        self.costs.observe_lookup(len(requests), self.clock() - started_s)
        is_lookup_dear = self.costs.lookup_cost(len(requests)) >= DEAR_LOOKUP
        num_drafts = 0
        for request, drafts in zip(requests, proposed, strict=True):
            history = self._hand_over(request, drafts)
            history.found(history.num_drafted, is_lookup_dear)
            num_drafts += history.num_drafted
        return num_drafts

    def _peek(self, decoding: list[Request], limits: list[int]) -> int:
        """Ask about the paused requests due a peek (see above); a draft of `LONG_DRAFT`
        tokens or more (or all it has room for) ends a pause. How many drafts were given."""
        if not self.proposer.can_peek:
            return 0
        peeking, room = [], []
        for request, limit in zip(decoding, limits, strict=True):
            history = self.histories[request.request_id][1]
            is_paused = limit == 0 and history.pause_steps > 0 and not request.grammar_future
            is_due = is_paused and history.is_peek_due(self.step_index)
            if is_due and (num_room := self._room(request)):
                peeking.append(request)
                room.append(num_room)
        if not peeking:
            return 0
        num_drafts = 0
        proposed = self.proposer.peek(peeking, room)
        for request, num_room, drafts in zip(peeking, room, proposed, strict=True):
            if len(drafts) >= min(LONG_DRAFT, num_room):
                history = self._hand_over(request, drafts)
                history.end_pause()
                num_drafts += history.num_drafted
            else:
                self.histories[request.request_id][1].peeked_in_vain(len(drafts))
        return num_drafts

    def _hand_over(self, request: Request, drafts: list[int]) -> DraftHistory:
        """Give `request` these drafts (cut where its grammar refuses); its history."""
        if request.grammar is not None:  # only what the grammar accepts is drafted
            drafts = drafts[: request.grammar.count_valid(drafts)]
        request.spec_token_ids = drafts
        history = self.histories[request.request_id][1]
        history.num_drafted = len(drafts)
        history.num_output_before = request.num_output_tokens
        return history

    def _draft_limit(self, request: Request) -> int:
        """How many tokens `request` may have drafted for its next step (0: none)."""
        if request.request_id not in self.histories:  # (not setdefault: made once, not per step)
            self.histories[request.request_id] = (request, DraftHistory())
        history = self.histories[request.request_id][1]
        if request.grammar_future is not None:
            return 0  # its grammar is still being built
        if history.pause_steps > 0:
            history.pause_steps -= 1
            return 0
        return self._room(request)

    def _room(self, request: Request) -> int:
        """The most drafts `request` can take: `num_speculative_tokens`, and one fewer than
        the tokens it has left."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            return self.num_speculative_tokens
        num_left = max_tokens - request.num_output_tokens - 1  # after the verified token
        return max(0, min(self.num_speculative_tokens, num_left))

    def _time_last_step(self, requests: list[Request], now_s: float) -> None:
        """Tell `costs` how long the step just run took, if it ran the decoding requests the
        last `propose` saw and nothing else (no prompt chunk, none admitted, finished or left
        behind)."""
        step = self.in_flight
        if step is None or not step.is_decode_only or len(requests) != len(step.num_output_tokens):
            return
        before = step.num_output_tokens
        if any(
            r.request_id not in before or r.num_output_tokens <= before[r.request_id]
            for r in requests
        ):
            return  # a request joined the step, or was left out of it
        self.costs.observe(len(before), step.num_drafts, now_s - step.started_s)

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
