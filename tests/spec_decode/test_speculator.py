"""When the speculator drafts: decoding requests only, no grammars, within max_tokens, not at
large batches, as many as pay at the measured cost of a verify step, and not for a request
whose drafts keep failing (until it tries again)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.request import Request
from nanoserve.spec_decode.speculator import (
    FIRST_PAUSE_STEPS,
    LONG_DRAFT,
    MAX_PAUSE_STEPS,
    MAX_PEEK_EVERY,
    PEEK_EVERY,
    AdaptiveSpeculator,
    DraftHistory,
    plan_drafts,
)
from nanoserve.spec_decode.step_costs import MIN_SAMPLES, WINDOW, StepCosts


class FixedProposer:
    """Drafts `draft` (cut to the limit) for every request it is asked about."""

    can_peek = False

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft
        self.asked: list[list[str]] = []
        self.finished: list[str] = []

    def propose(self, requests, num_tokens):
        self.asked.append([r.request_id for r in requests])
        return [self.draft[:n] for n in num_tokens]

    def finish(self, request):
        self.finished.append(request.request_id)

    def close(self):
        pass


def decoding(request_id: str, max_tokens: int | None = 50) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    request.append_output_token(4)
    request.num_computed_tokens = 3  # the prompt is cached; the sampled token is next
    return request


class SetCosts(StepCosts):
    """StepCosts that keep the times they were given: the tests' steps, timed on the real
    clock in microseconds, do not move them."""

    is_set = False

    def observe(self, num_requests: int, num_drafts: int, seconds: float) -> None:
        if not self.is_set:
            super().observe(num_requests, num_drafts, seconds)


def timed_costs(verify_s: dict[int, float], plain_s: float = 1.0) -> StepCosts:
    """StepCosts set to plain steps (of 1 to 7 requests) of `plain_s` and single-request
    verify steps of T tokens of `verify_s[T]`."""
    costs = SetCosts()
    for _ in range(MIN_SAMPLES):
        for num_requests in range(1, 8):
            costs.observe(num_requests, 0, plain_s)
        for num_tokens, seconds in verify_s.items():
            costs.observe(1, num_tokens - 1, seconds)
    costs.is_set = True
    return costs


CHEAP = {2: 1.1, 3: 1.2, 4: 1.3}  # a draft costs a tenth of a plain step


def speculator(
    proposer, costs: StepCosts | None = None, clock=None, **config
) -> AdaptiveSpeculator:
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3} | config)
    if clock is None:
        return AdaptiveSpeculator(proposer, spec, costs or timed_costs(CHEAP))
    return AdaptiveSpeculator(proposer, spec, costs, clock)


def test_drafts_for_decoding_requests_within_max_tokens():
    proposer = FixedProposer([7, 8, 9, 10])
    chunked = Request("chunk", list(range(20)), SamplingParams(max_tokens=5))
    chunked.num_computed_tokens = 8  # its prompt is still running
    short = decoding("short", max_tokens=3)  # 1 of 3 out: 2 left, so 1 draft at most
    requests = [decoding("a"), chunked, short, decoding("open", max_tokens=None)]
    speculator(proposer).propose(requests)
    assert [r.spec_token_ids for r in requests] == [[7, 8, 9], [], [7], [7, 8, 9]]


class PrefixGrammar:
    """Accepts drafts up to the first 9."""

    def count_valid(self, token_ids):
        return token_ids.index(9) if 9 in token_ids else len(token_ids)


def test_constrained_drafts_stop_where_the_grammar_refuses_and_pending_ones_get_none():
    proposer = FixedProposer([7, 8, 9, 10])
    constrained, pending = decoding("g"), decoding("p")
    constrained.grammar = PrefixGrammar()  # type: ignore[assignment]
    pending.grammar_future = Future()
    speculator(proposer).propose([constrained, pending, decoding("free")])
    assert proposer.asked == [["g", "free"]]
    assert constrained.spec_token_ids == [7, 8] and pending.spec_token_ids == []


def test_no_drafts_at_the_batch_size_that_disables_them():
    proposer = FixedProposer([7])
    speculator(proposer, disable_by_batch_size=3).propose([decoding(str(i)) for i in range(3)])
    assert proposer.asked == []
    speculator(proposer, disable_by_batch_size=3).propose([decoding(str(i)) for i in range(2)])
    assert proposer.asked == [["0", "1"]]


def step(request: Request, num_accepted: int) -> None:
    """What the engine does with a verified step: the accepted drafts and one more token."""
    for token_id in [*request.spec_token_ids[:num_accepted], 0]:
        request.append_output_token(token_id)
    request.num_computed_tokens = request.num_tokens - 1
    request.spec_token_ids = []


def test_fewer_drafts_as_they_fail_then_a_pause_then_one_draft_again():
    proposer = FixedProposer([7, 8, 9])
    spec, request = speculator(proposer), decoding("a", max_tokens=None)
    lengths = []
    for _ in range(4):  # every draft rejected: the chance falls 1.0 -> 0.41 -> 0.22 -> 0.13
        spec.propose([request])
        lengths.append(len(request.spec_token_ids))
        step(request, 0)
    assert lengths == [3, 2, 1, 1]  # at 0.13 one draft still pays: it costs 0.1 of a step
    # At 0.08 not even one: plain steps for a while, FIRST_PAUSE_STEPS or up to PEEK_EVERY - 1
    # more, so that the trial falls on a step whose number is a multiple of PEEK_EVERY.
    assert FIRST_PAUSE_STEPS <= steps_without_drafts(spec, request) < 2 * FIRST_PAUSE_STEPS
    assert spec.step_index % PEEK_EVERY == 0
    assert request.spec_token_ids == [7]  # then one draft again
    step(request, 0)
    spec.propose([request])  # the trial missed: 0.3 -> 0.12, still worth a tenth of a step
    assert request.spec_token_ids == [7]
    step(request, 0)  # missed again, 0.07: paused (drafting paid last: not longer)
    assert FIRST_PAUSE_STEPS <= steps_without_drafts(spec, request) < 2 * FIRST_PAUSE_STEPS
    assert request.spec_token_ids == [7] and spec.step_index % PEEK_EVERY == 0  # a trial


def steps_without_drafts(spec: AdaptiveSpeculator, request: Request) -> int:
    """Steps (whose drafts all miss) until `request` is given drafts, in its step."""
    num_steps = 0
    while True:
        spec.propose([request])
        if request.spec_token_ids:
            return num_steps
        num_steps += 1
        step(request, 0)


def test_a_request_that_accepts_some_drafts_keeps_drafting_fewer():
    costs = timed_costs({2: 1.2, 3: 1.4, 4: 1.6})  # a draft costs a fifth of a step
    spec, request = speculator(FixedProposer([7, 8, 9]), costs), decoding("a", max_tokens=None)
    lengths = []
    for _ in range(12):
        spec.propose([request])
        lengths.append(len(request.spec_token_ids))
        step(request, 1 if request.spec_token_ids else 0)  # the first draft holds, not the next
    assert lengths[0] == 3 and all(n >= 1 for n in lengths) and lengths[-1] < 3


def test_a_request_whose_drafts_hold_keeps_drafting_and_finished_ones_are_forgotten():
    proposer = FixedProposer([7, 8, 9])
    spec, request = speculator(proposer), decoding("a", max_tokens=None)
    for _ in range(20):
        spec.propose([request])
        assert request.spec_token_ids == [7, 8, 9]
        step(request, 3)
    request.status = request.status.FINISHED
    spec.propose([])
    assert proposer.finished == ["a"] and spec.histories == {}


def geometric(chance: float, num_drafts: int) -> list[float]:
    """Each draft held with `chance` if the one before did: chance^j for the j-th."""
    return [chance**j for j in range(1, num_drafts + 1)]


def test_the_plan_drafts_more_when_verifying_is_cheap_and_none_when_it_is_dear():
    # One request whose drafts hold half the time; costs[D]: verifying D drafts, in plain steps.
    half = [geometric(0.5, 3)]
    assert plan_drafts(half, [1.0, 1.05, 1.1, 1.15], 1) == [3]
    assert plan_drafts(half, [1.0, 1.2, 1.4, 1.6], 1) == [1]
    assert plan_drafts(half, [1.0, 1.6, 1.8, 2.0], 1) == [0]
    assert plan_drafts([geometric(0.95, 3)], [1.0, 1.6, 1.8, 2.0], 1) == [3]  # 3.71 for 2.0
    # A first draft at 0.6 whose followers, once it holds, hold at 0.95: worth 3 after all.
    dear = [1.0, 1.6, 2.0, 2.3]
    assert plan_drafts([geometric(0.6, 3)], dear, 1) == [0]
    assert plan_drafts([[0.6, 0.57, 0.54]], dear, 1) == [3]


@pytest.mark.parametrize("one_draft_cost", [1.1, 1.3, 1.5, 1.8])
def test_a_lone_draft_is_made_when_its_chance_beats_what_it_adds_to_the_step(one_draft_cost):
    extra = one_draft_cost - 1.0  # the break-even chance follows the measured cost
    assert plan_drafts([[extra + 0.01]], [1.0, one_draft_cost], 1) == [1]
    assert plan_drafts([[extra - 0.01]], [1.0, one_draft_cost], 1) == [0]


def test_in_a_batch_the_likeliest_drafts_share_the_verify_step():
    costs = [1.0, 1.3, 1.35, 1.4, 1.45, 1.5, 1.55]  # a dear first draft, then cheap ones
    assert plan_drafts([geometric(0.9, 3), geometric(0.1, 3)], costs, 2) == [3, 0]
    assert plan_drafts([geometric(0.9, 3), geometric(0.9, 3)], costs, 2) == [3, 3]
    assert plan_drafts([[1.0, 1.0], []], costs, 2) == [2, 0]  # ties: a request's in order


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def run_timed(spec: AdaptiveSpeculator, clock: Clock, request: Request, plain_s: float,
              per_draft_s: float, num_steps: int, num_accepted: int = 0) -> list[int]:  # fmt: skip
    """`num_steps` engine steps whose time the clock shows; the drafts given for each."""
    lengths = []
    for _ in range(num_steps):
        spec.propose([request])
        drafts = len(request.spec_token_ids)
        lengths.append(drafts)
        clock.now_s += plain_s + (per_draft_s * (1 + drafts) if drafts else 0.0)
        step(request, min(num_accepted, drafts))
    return lengths


def test_steps_timed_on_the_clock_decide_the_drafts():
    """First plain steps to time them; then drafts while the verify steps stay cheap, and
    none once they are timed dear, but for a trial draft after each pause. Each request's
    first draft always holds, its second never."""
    proposer = FixedProposer([7, 8, 9])
    clock = Clock()
    spec = speculator(proposer, StepCosts(), clock=clock)
    cheap = run_timed(spec, clock, decoding("a", max_tokens=None), 1.0, 0.05, 30, 1)
    assert cheap[:MIN_SAMPLES] == [0] * MIN_SAMPLES and cheap[MIN_SAMPLES] == 3  # the prior's
    assert cheap[MIN_SAMPLES + 1 :] == [2] * (30 - MIN_SAMPLES - 1)  # 2.2 tokens for 1.15
    assert spec.costs.relative_costs(1, 2)[2] == pytest.approx(1.15)  # 3 tokens: 1 + 3 x 0.05
    spec = speculator(proposer, StepCosts(), clock=clock)
    dear = run_timed(spec, clock, decoding("b", max_tokens=None), 1.0, 0.8, 30, 1)
    assert spec.costs.relative_costs(1, 2)[2] == pytest.approx(3.4)
    first_pause = dear.index(0, MIN_SAMPLES)  # once the 3-token step is timed dear: none
    trial = dear.index(1, first_pause)  # a trial, then a pause twice as long, and another
    second_trial = dear.index(1, trial + 1)
    assert FIRST_PAUSE_STEPS <= trial - first_pause < FIRST_PAUSE_STEPS + PEEK_EVERY
    assert 2 * FIRST_PAUSE_STEPS <= second_trial - trial - 1 < 2 * FIRST_PAUSE_STEPS + PEEK_EVERY
    assert (trial + 1) % PEEK_EVERY == 0 and (second_trial + 1) % PEEK_EVERY == 0  # (steps
    # counted from 1)


class EmptyProposer(FixedProposer):
    """Finds nothing to draft, and takes `lookup_s` on the clock to say so."""

    def __init__(self, clock: Clock, lookup_s: float) -> None:
        super().__init__([])
        self.clock, self.lookup_s = clock, lookup_s

    def propose(self, requests, num_tokens):
        self.clock.now_s += self.lookup_s
        return super().propose(requests, num_tokens)


@pytest.mark.parametrize("lookup_s", [0.0001, 0.05])
def test_a_proposer_that_finds_nothing_is_asked_less_often_where_asking_costs(lookup_s):
    clock = Clock()
    proposer = EmptyProposer(clock, lookup_s)
    spec = speculator(proposer, timed_costs(CHEAP), clock=clock)
    request = decoding("a", max_tokens=None)
    asked_at = []
    for index in range(40):
        spec.propose([request])
        if proposer.asked and len(proposer.asked) > len(asked_at):
            asked_at.append(index)
        clock.now_s += 1.0
        step(request, 0)
    if lookup_s < 0.01:  # a hundredth of a step or less: asked every step
        assert asked_at == list(range(40))
    else:  # after the first 3 timed asks: waits of 0, 1, 3, 7, 15 steps, then 15 again
        assert asked_at == [0, 1, 2, 3, 5, 9, 17, 33]


def test_drafts_that_hold_together_are_estimated_by_position():
    """Half the steps miss at the first draft, the rest keep all three: past the first, the
    drafts hold almost surely, not with the first's chance again."""
    history = DraftHistory()
    for _ in range(10):
        history.learn(0, 3)
        history.learn(3, 3)
    first, second, third = history.acceptance(3)
    assert 0.5 < first < 0.65  # decayed: the last step (all held) counts most
    assert second / first > 0.8 and third / second > 0.8  # where one chance would say 0.59
    chances = history.acceptance(5)  # positions never reached keep the last one's chance
    assert chances[3] / chances[2] == pytest.approx(third / second)


class LikelihoodProposer(FixedProposer):
    """A FixedProposer whose drafts' lengths say how sure it is (as suffix decoding's): its
    peeks are its drafts."""

    can_peek = True

    def peek(self, requests, num_tokens):
        return self.propose(requests, num_tokens)


def paused_steps(spec: AdaptiveSpeculator, request: Request, num_steps: int) -> list[list[int]]:
    """`num_steps` steps whose drafts all miss; the drafts given for each."""
    given = []
    for _ in range(num_steps):
        spec.propose([request])
        given.append(list(request.spec_token_ids))
        step(request, 0)
    return given


@pytest.mark.parametrize("can_peek", [True, False])
def test_a_long_draft_ends_a_pause_where_the_proposer_can_peek(can_peek):
    proposer = (LikelihoodProposer if can_peek else FixedProposer)([7, 8])
    spec = speculator(proposer, num_speculative_tokens=2 * LONG_DRAFT)
    request = decoding("a", max_tokens=None)
    spec.propose([request])
    step(request, 2)
    history = spec.histories["a"][1]
    history.next_pause = 4 * PEEK_EVERY
    history.pause(spec.step_index, can_peek, False)  # (this step the first)
    proposer.asked.clear()
    if not can_peek:  # a draft model cannot tell a sure draft from a guess: paused
        # for its pause, not asked, then a trial
        assert paused_steps(spec, request, 3 * PEEK_EVERY) == [[]] * (3 * PEEK_EVERY)
        assert proposer.asked == []
        return
    # Short drafts (2 tokens) leave the pause as it is (no blind trial either); asked every
    # PEEK_EVERY steps at first, then half as often after each draft no longer than the one
    # before (the first, 2 tokens after none, grew), down to MAX_PEEK_EVERY.
    asked_at = []
    for _ in range(5 * MAX_PEEK_EVERY):
        assert paused_steps(spec, request, 1) == [[]]
        if proposer.asked:
            asked_at.append(spec.step_index)
            proposer.asked.clear()
    intervals = [min(PEEK_EVERY * 2 ** max(0, i - 1), MAX_PEEK_EVERY) for i in range(len(asked_at))]
    assert asked_at[0] % PEEK_EVERY == 0 and asked_at[0] - spec.step_index < 5 * MAX_PEEK_EVERY
    for before, at, interval in zip(asked_at, asked_at[1:], intervals[1:], strict=False):
        assert at == before + interval - before % interval  # the next step of its interval
    assert intervals[-1] == MAX_PEEK_EVERY and len(asked_at) >= 6
    long_draft = list(range(10, 10 + LONG_DRAFT))
    proposer.draft = long_draft
    assert steps_without_drafts(spec, request) < MAX_PEEK_EVERY  # the next peek's step
    assert request.spec_token_ids == long_draft and spec.step_index % MAX_PEEK_EVERY == 0
    assert history.pause_steps == 0 and not history.is_trial_due
    step(request, LONG_DRAFT)  # it held: drafting by the plan again
    spec.propose([request])
    assert len(request.spec_token_ids) > 0
    history.pause(spec.step_index, True, False)  # a new pause asks every PEEK_EVERY steps again
    step(request, 0)
    assert steps_without_drafts(spec, request) < PEEK_EVERY


class GrowingProposer(LikelihoodProposer):
    """Offers one token more at each ask (a match lengthening as a passage is repeated)."""

    def propose(self, requests, num_tokens):
        self.draft = [*self.draft, 7]
        return super().propose(requests, num_tokens)


def test_a_paused_request_offered_longer_drafts_each_time_is_asked_as_often():
    proposer = GrowingProposer([])
    spec = speculator(proposer, num_speculative_tokens=2 * LONG_DRAFT)
    request = decoding("a", max_tokens=None)
    spec.propose([request])
    step(request, 0)
    spec.histories["a"][1].pause(spec.step_index, True, False)
    proposer.asked.clear()
    proposer.draft = []
    asked_at = []
    while not request.spec_token_ids:
        spec.propose([request])
        if proposer.asked:
            asked_at.append(spec.step_index)
            proposer.asked.clear()
        if not request.spec_token_ids:
            step(request, 0)
    # Drafts of 1, 2, ... 5 tokens, every PEEK_EVERY steps; the sixth ends the pause.
    assert len(asked_at) == LONG_DRAFT and len(request.spec_token_ids) == LONG_DRAFT
    assert all(b - a == PEEK_EVERY for a, b in zip(asked_at, asked_at[1:], strict=False))


@pytest.mark.parametrize("num_requests", [1, 2])
def test_a_request_that_can_peek_tries_blind_only_when_alone(num_requests):
    """A trial beside other requests makes their step a verify step too: there a request whose
    proposer can peek waits for its peeks (or MAX_PAUSE_STEPS); alone it tries after its pause."""
    spec = speculator(LikelihoodProposer([7, 8]), num_speculative_tokens=2 * LONG_DRAFT)
    requests = [decoding(str(i), max_tokens=None) for i in range(num_requests)]
    histories = []
    for _ in range(20):  # every draft rejected until the plan pauses them
        spec.propose(requests)
        histories = [spec.histories[r.request_id][1] for r in requests]
        for request in requests:
            step(request, 0)
        if all(h.pause_steps > 0 for h in histories):
            break
    longest = MAX_PAUSE_STEPS if num_requests > 1 else 2 * FIRST_PAUSE_STEPS
    assert all(longest - 1 <= h.pause_steps + 2 * PEEK_EVERY for h in histories)
    assert all(h.pause_steps < longest + PEEK_EVERY for h in histories)


def test_long_drafts_that_keep_failing_are_peeked_for_less_and_less_often():
    """A long draft ends a pause; when such drafts fail at once a second time in a row, the
    next pause's peeks start half as often, and so on (else such a request, beside another,
    made every fourth step a verify step); drafts that pay bring the frequent peeks back."""
    proposer = LikelihoodProposer(list(range(100, 100 + 2 * LONG_DRAFT)))  # long, always wrong
    spec = speculator(proposer, num_speculative_tokens=2 * LONG_DRAFT)
    requests = [decoding("a", max_tokens=None), decoding("b", max_tokens=None)]
    verify_steps = []
    for step_number in range(8 * MAX_PEEK_EVERY):
        spec.propose(requests)
        if any(r.spec_token_ids for r in requests):
            verify_steps.append(step_number)
        for request in requests:
            step(request, 0)
    gaps = [b - a for a, b in zip(verify_steps, verify_steps[1:], strict=False)]
    assert gaps[-3:] == [MAX_PEEK_EVERY] * 3  # backed off as far as peeks go
    assert len(verify_steps) < 8 + 8 * 2  # (every 4th step without the back-off: 64)
    # Drafted at steps 0 and 1 (a fresh chance), paused, a peek's draft at step 3: after its
    # failure the next comes PEEK_EVERY steps later (one failure is left alone), after the
    # second's twice that.
    assert verify_steps[:3] == [0, 1, 3] and gaps[2:4] == [PEEK_EVERY, 2 * PEEK_EVERY]
    history = spec.histories["a"][1]
    history.drafts_pay()
    assert history.first_peek_every == PEEK_EVERY and history.next_pause == FIRST_PAUSE_STEPS
    assert history.num_failed_peek_drafts == 0


def test_a_draft_filling_a_paused_requests_room_ends_its_pause():
    """A request with room for fewer than LONG_DRAFT drafts (`num_speculative_tokens` below
    it, or near its max_tokens): a draft of all of them will do (else it would never resume)."""
    proposer = LikelihoodProposer([7, 8, 9])
    spec = speculator(proposer, num_speculative_tokens=3)
    request = decoding("a", max_tokens=None)
    spec.propose([request])
    step(request, 3)
    spec.histories["a"][1].pause(spec.step_index, True, False)
    assert steps_without_drafts(spec, request) < PEEK_EVERY
    assert request.spec_token_ids == [7, 8, 9]


class ScriptedProposer(LikelihoodProposer):
    """Drafts 0 to 8 tokens, as many as a hash of the request's id and length says, and
    takes a twentieth of a step on the clock to say so (a lookup worth sparing)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__([])
        self.clock = clock

    def propose(self, requests, num_tokens):
        self.asked.append([r.request_id for r in requests])
        self.clock.now_s += 0.05
        return [
            list(range(100, 100 + min(n, scripted(r.request_id, r.num_tokens, 9))))
            for r, n in zip(requests, num_tokens, strict=True)
        ]


def scripted(request_id: str, num_tokens: int, modulo: int) -> int:
    return (sum(map(ord, request_id)) * 7919 + num_tokens * 104729) % 997 % modulo


class NeverQuiet(AdaptiveSpeculator):
    def _begin_quiet(self, requests):
        pass


def test_quiet_spells_skip_steps_without_changing_a_single_draft():
    """Requests joining and leaving, drafts of every length accepted in part: the drafts given
    at every step are the same with quiet spells as without, in fewer full proposes."""
    runs = []
    for speculator_class in (AdaptiveSpeculator, NeverQuiet):
        clock = Clock()
        proposer = ScriptedProposer(clock)
        spec = speculator_class(
            proposer,
            SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8}),
            timed_costs({2: 1.3, 5: 1.6, 9: 2.2}),
            clock,
        )
        requests = {name: decoding(name, max_tokens=None) for name in "abcd"}
        given, num_full = [], 0
        original = spec._learn_from_last_step

        def counted(original=original):
            nonlocal num_full
            num_full += 1
            original()

        spec._learn_from_last_step = counted  # type: ignore[method-assign]
        for index in range(600):
            if index < 300:  # (as if preempted and resumed now and then)
                running = [r for name, r in requests.items() if scripted(name, index // 10, 3)]
            else:  # one request alone, so pauses grow long, and another now and then
                running = [requests["a"]] + ([requests["b"]] if index % 37 == 0 else [])
            spec.propose(running)
            given.append([list(r.spec_token_ids) for r in running])
            clock.now_s += 1.0
            for request in running:
                drafts = len(request.spec_token_ids)
                step(request, min(drafts, scripted(request.request_id, request.num_tokens, 4)))
        runs.append((given, num_full, spec.totals, proposer.asked))
    (quiet, num_quiet_full, quiet_totals, quiet_asked), (every, num_every, totals, asked) = runs
    assert quiet == every and quiet_asked == asked and quiet_totals == totals
    assert sum(map(len, asked)) > 50  # drafts were asked for, and given
    assert num_every == 600 and num_quiet_full < 500  # (483 as written)


def test_a_quiet_spells_steps_are_timed_as_plain_steps_without_the_full_proposes_cost():
    """Steps take 1.0 on the clock, and a full `propose` 0.5 more: the plain steps timed in a
    long pause are the skipped ones, at 1.0 (what a step costs without speculation's work)."""
    clock = Clock()
    spec = speculator(FixedProposer([7]), StepCosts(), clock=clock)
    request = decoding("a", max_tokens=None)
    original = spec._learn_from_last_step

    def full_propose_costs(original=original):
        clock.now_s += 0.5
        original()

    spec._learn_from_last_step = full_propose_costs  # type: ignore[method-assign]
    for _ in range(MIN_SAMPLES + 1):  # plain steps to time, then a draft
        spec.propose([request])
        clock.now_s += 1.0
        step(request, 0)
    history = spec.histories["a"][1]
    history.next_pause = 64
    history.pause(spec.step_index, False, True)
    for _ in range(40):
        spec.propose([request])
        clock.now_s += 1.0
        step(request, 0)
    timed = list(spec.costs.plain[1].seconds)
    assert len(timed) == WINDOW and timed == [1.0] * WINDOW
