"""When the speculator drafts: decoding requests only, no grammars, within max_tokens, not at
large batches, and not for a request whose drafts keep failing (until it tries again)."""

from __future__ import annotations

from concurrent.futures import Future

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.request import Request
from nanoserve.spec_decode.speculator import FIRST_PAUSE_STEPS, AdaptiveSpeculator


class FixedProposer:
    """Drafts `draft` (cut to the limit) for every request it is asked about."""

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


def speculator(proposer, **config) -> AdaptiveSpeculator:
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3} | config)
    return AdaptiveSpeculator(proposer, spec)


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
    spec.propose([request])
    assert request.spec_token_ids == [7, 8, 9]  # no history: every draft is worth it
    step(request, 0)
    spec.propose([request])  # one rejection at the first draft: the chance is ~0.4
    assert request.spec_token_ids == [7]
    step(request, 0)
    num_paused = 0
    while True:  # the chance fell under 0.3: plain steps for a while
        spec.propose([request])
        if request.spec_token_ids:
            break
        num_paused += 1
        step(request, 0)
    assert num_paused == FIRST_PAUSE_STEPS
    assert request.spec_token_ids == [7]  # then one draft again
    step(request, 0)
    spec.propose([request])  # failed again at once: a pause twice as long
    assert request.spec_token_ids == []
    assert spec.histories["a"][1].pause_steps == 2 * FIRST_PAUSE_STEPS - 1


def test_a_request_that_accepts_some_drafts_keeps_drafting_fewer():
    spec, request = speculator(FixedProposer([7, 8, 9])), decoding("a", max_tokens=None)
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
