"""The rejection sampler keeps the target distribution (in the manner of vLLM's
`test_rejection_sampling_approximates_target_distribution`), greedy rows follow the argmax,
seeded requests repeat themselves, and emitted tokens carry their raw logprobs."""

from __future__ import annotations

import pytest
import torch

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.sampler import Sampler
from nanoserve.core.sampling_batch import SamplingBatch, seeded_generator
from nanoserve.spec_decode.rejection_sampler import RejectionSampler, uniform_pairs

VOCAB = 12
DRAFTS = [3, 7, 1]
WARPERS = {
    "plain": {},
    "temperature": {"temperature": 0.6},
    "top_k": {"top_k": 4},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.15},
    "penalties": {"repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.3},
    "logit_bias": {"logit_bias": {3: -1.0, 5: 2.0}},
    "all": {"temperature": 0.8, "top_k": 6, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.4},
}
PROMPT = [2, 3, 4]


def batch_for(params: list[SamplingParams], histories: list[list[int]], generators=None):
    return SamplingBatch.build(
        params=params,
        prompt_token_ids=[PROMPT] * len(params),
        output_token_ids=histories,
        generators=generators or [None] * len(params),
        vocab_size=VOCAB,
        device=torch.device("cpu"),
        eos_token_ids=frozenset(),
    )


def expanded_batch(params: SamplingParams, num_requests: int, generators=None):
    """`num_requests` copies of one request with DRAFTS: rows (last token, each draft)."""
    rows = [DRAFTS[:j] for _ in range(num_requests) for j in range(len(DRAFTS) + 1)]
    gens = None if generators is None else [g for g in generators for _ in range(len(DRAFTS) + 1)]
    return batch_for([params] * len(rows), rows, gens)


def target_distribution(params: SamplingParams, logits: torch.Tensor, history: list[int]):
    """What the plain sampler draws from for one request that has output `history`."""
    batch = batch_for([params], [history])
    return Sampler().process_logits(logits.unsqueeze(0), batch).softmax(-1)[0]


def empirical(samples: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).float()
    return counts / counts.sum()


@pytest.mark.parametrize("warper", WARPERS)
def test_rejection_sampling_approximates_target_distribution(warper):
    torch.manual_seed(0)
    params = SamplingParams(**({"temperature": 1.0, "max_tokens": 8} | WARPERS[warper]))
    logits = torch.randn(len(DRAFTS) + 1, VOCAB) * 2  # [k + 1, V]: one row per position
    for position, draft in enumerate(DRAFTS):
        logits[position, draft] = logits[position].max() + 0.5  # likely drafts, not certain
    sampler, num_requests = RejectionSampler(), 4000
    first, second = [], []  # the first emitted token; the second, where the first draft held
    for _ in range(5):
        batch = expanded_batch(params, num_requests)
        token_ids, _ = sampler(logits.repeat(num_requests, 1), batch, [DRAFTS] * num_requests)
        first += [t[0] for t in token_ids]
        second += [t[1] for t in token_ids if len(t) > 1]
    for samples, position in ((first, 0), (second, 1)):
        target = target_distribution(params, logits[position], DRAFTS[:position])
        distance = (empirical(samples) - target).abs().sum().item()
        assert len(samples) > 1000 and distance < 0.06, (position, len(samples), distance)
        # Far closer to the target than to random distributions over the same support that
        # differ from it noticeably (the rejection step must not pull towards the drafts).
        for _ in range(20):
            other = torch.distributions.Dirichlet(torch.ones(VOCAB)).sample() * (target > 0)
            other = other / other.sum()
            if (other - target).abs().sum() > 0.2:
                assert (empirical(samples) - other).abs().sum().item() > 2 * distance
        draft_only = torch.zeros(VOCAB)
        draft_only[DRAFTS[position]] = 1.0  # always accepting would give this
        assert (empirical(samples) - draft_only).abs().sum().item() > 5 * distance


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    logits = torch.full((4, VOCAB), -1.0)
    for row, token in enumerate([3, 7, 2, 9]):  # argmax: 3, 7, then 2 where the draft says 1
        logits[row, token] = 5.0
    params = SamplingParams(temperature=0.0, max_tokens=8)
    token_ids, logprobs = RejectionSampler()(logits, expanded_batch(params, 1), [DRAFTS])
    assert token_ids == [[3, 7, 2]] and logprobs == [None]
    logits[2, 1] = 9.0  # now every draft is the argmax: all kept, and the bonus token
    token_ids, _ = RejectionSampler()(logits, expanded_batch(params, 1), [DRAFTS])
    assert token_ids == [[3, 7, 1, 9]]


def test_a_greedy_request_beside_a_random_one_keeps_the_argmax_and_the_other_draws():
    torch.manual_seed(3)
    logits = torch.cat([torch.full((4, VOCAB), -1.0), torch.randn(4, VOCAB)])
    for row, token in enumerate([3, 7, 2, 9]):  # the greedy request's rows
        logits[row, token] = 5.0
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    random = SamplingParams(temperature=1.0, max_tokens=8)
    batch = batch_for([greedy] * 4 + [random] * 4, [DRAFTS[:j] for j in range(4)] * 2)
    lengths = set()
    for _ in range(40):
        token_ids, _ = RejectionSampler()(logits, batch, [DRAFTS, DRAFTS])
        assert token_ids[0] == [3, 7, 2]
        *kept, last = token_ids[1]
        assert kept == DRAFTS[: len(kept)]
        if len(kept) < len(DRAFTS):  # rejected there: drawn from p without that draft
            assert last != DRAFTS[len(kept)]
        lengths.add(len(kept))
    assert len(lengths) > 1  # random: some drafts kept, some not


def test_requests_without_drafts_sample_one_token_beside_verified_ones():
    logits = torch.randn(5, VOCAB)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    batch = batch_for([greedy] * 5, [[], [], [3], [3, 7], []])
    sampler = RejectionSampler()
    token_ids, _ = sampler(logits, batch, [[], [3, 7, 1]])
    assert token_ids[0] == [int(logits[0].argmax())]
    assert len(token_ids[1]) == 1 + sampler.num_accepted[1]


def test_seeded_requests_repeat_their_tokens():
    torch.manual_seed(1)
    logits = torch.randn(4 * 8, VOCAB)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)

    def run() -> list[list[int]]:
        generators = [seeded_generator(5 + i, torch.device("cpu")) for i in range(8)]
        batch = expanded_batch(params, 8, generators)
        torch.rand(100)  # the default generator moves on; seeded rows must not care
        return RejectionSampler()(logits, batch, [DRAFTS] * 8)[0]

    assert run() == run()


def test_a_seeded_requests_rows_draw_their_uniforms_in_one_call_as_row_by_row():
    """Two requests with their own generators (4 rows each) beside an unseeded one: the
    pairs are what two passes of one draw per row (the plain sampler's) give."""
    params = SamplingParams(temperature=1.0, max_tokens=8)

    def batch():
        generators = [seeded_generator(seed, torch.device("cpu")) for seed in (3, 4)]
        return expanded_batch(params, 3, [generators[0], None, generators[1]])

    first, second = batch(), batch()
    torch.manual_seed(7)
    pairs = uniform_pairs(first, torch.device("cpu"))  # [2, 12]
    torch.manual_seed(7)
    row_by_row = [Sampler.uniforms(second, torch.device("cpu")) for _ in range(2)]
    assert len(first.seeded_rows) == 8 and torch.equal(pairs, torch.stack(row_by_row))


def test_emitted_tokens_carry_their_raw_logprobs():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, max_tokens=8, logprobs=2)
    token_ids, logprobs = RejectionSampler()(logits, expanded_batch(params, 1), [DRAFTS])
    entries = logprobs[0]
    assert entries is not None and len(entries) == len(token_ids[0])
    raw = logits.log_softmax(-1)
    for row, (token_id, entry) in enumerate(zip(token_ids[0], entries, strict=True)):
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(raw[row, token_id].item(), abs=1e-5)
        assert entry.top_token_ids == raw[row].topk(2).indices.tolist()
