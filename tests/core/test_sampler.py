"""Sampler: processed logits against transformers' logits processors, sampling, logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.sampler import Sampler, SamplerOps
from nanoserve.core.sampling_batch import SamplingBatch, seeded_generator

VOCAB = 64
EOS = 7
CPU = torch.device("cpu")


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int = VOCAB,
    eos_token_ids: frozenset[int] = frozenset({EOS}),
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts or [[1, 2, 3]] * n,
        outputs or [[]] * n,
        generators or [None] * n,
        vocab_size,
        CPU,
        eos_token_ids=eos_token_ids,
    )


def random_logits(num_rows: int, seed: int = 0, vocab_size: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 3  # [B, V]


def assert_same_filtered(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same -inf pattern, and the same values where finite."""
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


def process(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    return Sampler().process_logits(logits, make_batch(params, **kwargs))


# ---- processed logits against transformers ------------------------------------------------


def test_temperature_matches_transformers():
    temperatures = [0.3, 0.7, 1.0, 1.5]
    logits = random_logits(len(temperatures))
    actual = process(logits, [SamplingParams(temperature=t) for t in temperatures])
    for i, t in enumerate(temperatures):
        expected = TemperatureLogitsWarper(t)(None, logits[i : i + 1].clone())
        assert_same_filtered(actual[i : i + 1], expected)


def test_top_k_matches_transformers_including_ties():
    top_ks = [1, 3, 10, VOCAB, VOCAB + 50, 0, -1]
    logits = random_logits(len(top_ks)).round()  # rounding makes ties at the k-th value
    actual = process(logits, [SamplingParams(top_k=k) for k in top_ks])
    for i, k in enumerate(top_ks):
        row = logits[i : i + 1].clone()
        expected = TopKLogitsWarper(k)(None, row) if k > 0 else row
        assert_same_filtered(actual[i : i + 1], expected)
    assert actual[3:].isfinite().all()  # k >= V and disabled rows keep every token


def test_top_p_matches_transformers():
    top_ps = [0.05, 0.3, 0.6, 0.9, 0.99, 1.0, 1e-9]  # 1e-9: 1 - p rounds to 1 in float32
    logits = random_logits(len(top_ps), seed=1)
    actual = process(logits, [SamplingParams(top_p=p) for p in top_ps])
    for i, p in enumerate(top_ps):
        row = logits[i : i + 1].clone()
        expected = TopPLogitsWarper(p)(None, row) if p < 1.0 else row
        assert_same_filtered(actual[i : i + 1], expected)
    assert actual[0].isfinite().sum() < actual[3].isfinite().sum() < VOCAB
    assert actual[-1].isfinite().sum() == 1  # the most likely token is always kept


def test_min_p_matches_transformers():
    min_ps = [0.0, 0.01, 0.1, 0.5, 1.0]
    logits = random_logits(len(min_ps), seed=2)
    actual = process(logits, [SamplingParams(min_p=m) for m in min_ps])
    for i, m in enumerate(min_ps):
        expected = MinPLogitsWarper(m)(None, logits[i : i + 1].clone())
        assert_same_filtered(actual[i : i + 1], expected)
    assert actual[-1].isfinite().sum() == 1


def test_repetition_penalty_matches_transformers():
    penalties = [1.3, 0.7, 1.0, 2.0]
    prompts = [[1, 2, 2, 5], [10, 11], [3, 4], [60, 61, 62]]
    outputs = [[5, 9, 9], [11, 12, 40], [8], []]
    logits = random_logits(len(penalties), seed=3)
    actual = process(
        logits,
        [SamplingParams(repetition_penalty=p) for p in penalties],
        prompts=prompts,
        outputs=outputs,
    )
    for i, p in enumerate(penalties):
        input_ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(p)(input_ids, logits[i : i + 1].clone())
        assert_same_filtered(actual[i : i + 1], expected)
    assert not torch.equal(actual[0], logits[0])
    assert torch.equal(actual[2], logits[2])  # penalty 1.0 changes nothing


def test_combined_order_matches_transformers_chain():
    """Our order: repetition penalty → temperature → top-k → top-p → min-p (transformers')."""
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        SamplingParams(temperature=1.5, top_k=5, top_p=0.5),
        SamplingParams(temperature=0.5, top_p=0.95, min_p=0.2, repetition_penalty=0.9),
        SamplingParams(temperature=1.0),
    ]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    outputs = [[11, 12], [13], [], [14, 15]]
    logits = random_logits(len(params), seed=4)
    actual = process(logits, params, prompts=prompts, outputs=outputs)
    for i, p in enumerate(params):
        input_ids = torch.tensor([prompts[i] + outputs[i]])
        row = logits[i : i + 1].clone()
        chain = [RepetitionPenaltyLogitsProcessor(p.repetition_penalty)]
        chain.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            chain.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            chain.append(TopPLogitsWarper(p.top_p))
        if p.min_p > 0.0:
            chain.append(MinPLogitsWarper(p.min_p))
        for processor in chain:
            row = processor(input_ids, row)
        assert_same_filtered(actual[i : i + 1], row)


# ---- penalties, bias, min_tokens ----------------------------------------------------------


def test_presence_and_frequency_penalties_follow_openai_formula():
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(presence_penalty=-1.0),
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(),
    ]
    prompts = [[20, 21], [20, 21], [20, 21], [20, 21]]  # prompt tokens are not penalised
    outputs = [[5, 5, 5, 9], [1, 2, 2], [30, 30, 31], [5, 5]]
    logits = random_logits(len(params), seed=5)
    actual = process(logits, params, prompts=prompts, outputs=outputs)

    expected = logits.clone()
    for i, p in enumerate(params):
        counts = torch.bincount(torch.tensor(outputs[i]), minlength=VOCAB).float()
        expected[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    torch.testing.assert_close(actual, expected)
    assert actual[0, 5] == pytest.approx(logits[0, 5].item() - 0.5 - 3 * 0.3, abs=1e-5)
    assert actual[0, 20] == logits[0, 20]


def test_logit_bias_is_added():
    params = [SamplingParams(logit_bias={3: 5.0, 40: -100.0}), SamplingParams(logit_bias={3: 1.5})]
    logits = random_logits(2, seed=6)
    actual = process(logits, params)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 40] -= 100.0
    expected[1, 3] += 1.5
    torch.testing.assert_close(actual, expected)
    greedy = make_batch([SamplingParams(temperature=0, logit_bias={9: 100})])
    assert Sampler()(logits[:1], greedy).token_ids == [9]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[11]),  # 2 outputs: still masked
        SamplingParams(min_tokens=2, stop_token_ids=[11]),  # 2 outputs: reached
        SamplingParams(min_tokens=3, stop_token_ids=[11], ignore_eos=True),
    ]
    outputs = [[1, 2], [1, 2], [1, 2]]
    logits = random_logits(3, seed=7)
    actual = process(logits, params, outputs=outputs)
    assert torch.isneginf(actual[0, [EOS, 11]]).all()
    assert actual[0].isfinite().sum() == VOCAB - 2
    assert torch.equal(actual[1], logits[1])
    assert torch.isneginf(actual[2, 11]) and actual[2, EOS] == logits[2, EOS]

    # Greedy never picks EOS before min_tokens, even when EOS is by far the most likely.
    logits[:, EOS] = 100.0
    greedy = [SamplingParams(temperature=0, min_tokens=3), SamplingParams(temperature=0)]
    output = Sampler()(logits[:2], make_batch(greedy, outputs=[[1], [1]]))
    assert output.token_ids[0] != EOS and output.token_ids[1] == EOS


# ---- choosing tokens ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_argmax_is_argmax_with_ties_infinities_and_nans(dtype):
    row_argmax = SamplerOps().argmax
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(-2, 3, (64, 5000), generator=generator).to(dtype)  # many ties a row
    rows[3, [10, 4000]] = float("inf")
    rows[5, [7, 900]] = float("nan")  # the first NaN wins, as with argmax
    rows[6] = float("-inf")  # all equal: index 0
    expected = rows.argmax(dim=-1)
    assert expected[5] == 7 and expected[6] == 0
    assert torch.equal(row_argmax(rows), expected)
    wide = torch.randn(8, 151936, generator=generator).to(dtype)  # a vocabulary-wide batch
    assert torch.equal(row_argmax(wide), wide.argmax(dim=-1))


def test_a_draw_takes_the_first_token_whose_running_sum_passes_the_uniform():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]]).expand(7, 6) * 3  # sums of 3
    uniforms = torch.tensor([0.0, 0.2, 0.25, 0.5, 0.74, 0.75, 1 - 2**-53], dtype=torch.float64)
    assert SamplerOps().draw(probs, uniforms).tolist() == [1, 1, 3, 3, 3, 4, 4]


def test_all_greedy_batch_is_argmax_and_builds_no_tensors():
    params = [SamplingParams(temperature=0)] * 5
    batch = make_batch(params)
    assert batch.all_greedy and batch.temperature is None and batch.top_k is None
    assert not batch.needs_penalties and batch.logprob_index is None
    logits = random_logits(5, seed=8)
    assert Sampler.apply_penalties(logits, batch) is logits  # nothing copied
    output = Sampler()(logits, batch)
    assert output.token_ids == logits.argmax(dim=-1).tolist()
    assert output.logprobs == [None] * 5


def test_greedy_rows_in_a_mixed_batch_take_argmax_of_penalised_logits():
    params = [
        SamplingParams(temperature=0, repetition_penalty=5.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0, top_k=1, top_p=0.1),  # filters don't matter to greedy
    ]
    logits = random_logits(3, seed=9)
    top = int(logits[0].argmax())
    logits[0, top] = 50.0
    outputs = [[top], [], []]
    batch = make_batch(params, outputs=outputs)
    assert batch.top_k is not None and batch.top_p_threshold is None  # greedy rows excluded
    token_ids = Sampler()(logits, batch).token_ids
    penalised = logits[0].clone()
    penalised[top] /= 5.0
    penalised[[1, 2, 3]] = torch.where(  # prompt [1, 2, 3] is penalised too
        penalised[[1, 2, 3]] < 0, penalised[[1, 2, 3]] * 5.0, penalised[[1, 2, 3]] / 5.0
    )
    assert token_ids[0] == int(penalised.argmax())
    assert token_ids[2] == int(logits[2].argmax())
    assert token_ids[1] in logits[1].topk(3).indices.tolist()


def run_steps(
    logits_per_step: list[torch.Tensor], params: list[SamplingParams], seeds: list[int | None]
) -> list[list[int]]:
    """Sample len(logits_per_step) steps with per-row generators made once; tokens per row."""
    generators = [None if s is None else seeded_generator(s, CPU) for s in seeds]
    sampler = Sampler()
    tokens: list[list[int]] = [[] for _ in params]
    for logits in logits_per_step:
        batch = make_batch(params, generators=generators)
        for row, token_id in enumerate(sampler(logits, batch).token_ids):
            tokens[row].append(token_id)
    return tokens


def test_seeded_rows_are_reproducible_and_independent_of_batch_neighbours():
    num_steps = 40
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    row_logits = [random_logits(1, seed=100 + s)[0] for s in range(num_steps)]  # [V] each

    alone = run_steps([r.unsqueeze(0) for r in row_logits], [seeded], [1234])[0]
    again = run_steps([r.unsqueeze(0) for r in row_logits], [seeded], [1234])[0]
    assert alone == again
    assert len(set(alone)) > 5  # it really sampled

    # The same row in the middle of a batch with unseeded, greedy and other seeded rows.
    torch.manual_seed(0)
    neighbours = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0),
        seeded,
        SamplingParams(temperature=1.2, top_k=5, seed=99),
    ]
    batched_logits = [
        torch.stack([torch.randn(VOCAB), torch.randn(VOCAB), r, torch.randn(VOCAB)])
        for r in row_logits
    ]
    in_batch = run_steps(batched_logits, neighbours, [None, None, 1234, 99])[2]
    assert in_batch == alone

    different_seed = run_steps([r.unsqueeze(0) for r in row_logits], [seeded], [4321])[0]
    assert different_seed != alone


def test_unseeded_rows_differ_across_calls():
    torch.manual_seed(0)
    logits = torch.zeros(1, VOCAB)  # uniform: 64 equally likely tokens
    batch = make_batch([SamplingParams(temperature=1.0)])
    draws = [Sampler()(logits, batch).token_ids[0] for _ in range(20)]
    assert len(set(draws)) > 5


@pytest.mark.parametrize("seeded", [False, True])
def test_sample_frequencies_match_the_distribution(seeded):
    num_draws = 4000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.0, 1.5]])  # [1, 8]
    params = SamplingParams(temperature=0.9, top_k=5, seed=7 if seeded else None)
    expected = Sampler().process_logits(logits, make_batch([params], vocab_size=8))
    probs = expected.softmax(dim=-1)[0]  # [8]
    assert (probs == 0).nonzero().flatten().tolist() == [4, 5]  # the tie at 0.0 keeps 6 tokens

    if seeded:  # one row over many steps, through the row's own generator
        generators = [seeded_generator(7, CPU)]
        batch = make_batch([params], vocab_size=8, generators=generators)
        sampler = Sampler()
        token_ids = [sampler(logits, batch).token_ids[0] for _ in range(num_draws)]
    else:  # many rows in one call, through the default generator
        torch.manual_seed(0)
        batch = make_batch([params] * num_draws, vocab_size=8)
        token_ids = Sampler()(logits.expand(num_draws, 8), batch).token_ids
    counts = torch.bincount(torch.tensor(token_ids), minlength=8).float()
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    expected_counts = probs[kept] * num_draws
    chi_square = ((counts[kept] - expected_counts) ** 2 / expected_counts).sum()
    assert chi_square < 25.0  # df = 5: p ≈ 1e-4 of failing by chance; fixed seeds anyway


# ---- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_rank_and_sorted_top_k():
    params = [
        SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.5, logit_bias={4: 3.0}),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),  # no logprobs
        SamplingParams(temperature=1.3, top_k=10, logprobs=20),
    ]
    torch.manual_seed(0)
    logits = random_logits(len(params), seed=10)
    raw = logits.log_softmax(dim=-1)  # [B, V]
    output = Sampler()(logits.clone(), make_batch(params, outputs=[[4], [], [], []]))

    assert output.logprobs[2] is None
    assert output.logprobs[1].top_token_ids == [] and output.logprobs[1].top_logprobs == []
    assert output.logprobs[1].rank == 1  # greedy took the most likely token
    for row in (0, 1, 3):
        lp = output.logprobs[row]
        token_id = output.token_ids[row]
        assert lp.token_id == token_id
        assert lp.logprob == pytest.approx(raw[row, token_id].item(), abs=1e-6)
        order = raw[row].argsort(descending=True).tolist()
        assert lp.rank == order.index(token_id) + 1
        k = params[row].logprobs
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == k
        assert lp.top_token_ids == order[:k]
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), raw[row, order[:k]])


def test_rank_of_a_low_token():
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)  # token 63 most likely
    params = [SamplingParams(temperature=0, logit_bias={0: 100.0}, logprobs=2)]
    lp = Sampler()(logits, make_batch(params)).logprobs[0]
    assert lp.token_id == 0 and lp.rank == VOCAB  # raw logprobs: the bias is not in them
    assert lp.top_token_ids == [63, 62]


def test_sampler_rejects_logits_of_another_batch():
    with pytest.raises(ValueError, match=r"logits must be \[2, 64\]"):
        Sampler()(random_logits(3), make_batch([SamplingParams()] * 2))


def test_build_rejects_lists_of_different_lengths():
    with pytest.raises(ValueError, match="one entry per request"):
        SamplingBatch.build(
            [SamplingParams()], [[1]], [[], []], [None], VOCAB, CPU, eos_token_ids=frozenset()
        )
