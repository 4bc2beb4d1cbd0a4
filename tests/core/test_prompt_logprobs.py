"""Prompt logprobs against transformers: batched, chunked, after prefix-cache hits, preempted."""

import random

import pytest
import torch
import transformers
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import FinishReason, TokenLogprobs
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine

PROMPT_LENGTHS = [1, 2, 7, 16, 17, 40, 64]
NUM_TOP = 5
TOLERANCE = 1e-5  # fp32 on both sides


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at positions 0..N-2: [N - 1, vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def assert_matches_reference(entries: list[TokenLogprobs], hf_model, prompt: list[int]):
    reference = reference_logprobs(hf_model, prompt)
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        row = reference[position]
        token_id = prompt[position + 1]
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=TOLERANCE)
        assert entry.rank == int((row >= row[token_id]).sum())
        top_values, top_ids = row.topk(NUM_TOP)
        assert entry.top_token_ids == top_ids.tolist()
        assert entry.top_logprobs == pytest.approx(top_values.tolist(), abs=TOLERANCE)


def make_engine(checkpoint, **overrides):
    args = {"model": str(checkpoint), "dtype": "float32", "device": "cpu", "max_model_len": 128}
    args.update(overrides)
    return Engine(EngineConfig(**args))


def scoring(max_tokens=2):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=NUM_TOP)


def run(engine, prompts, params):
    """Every prompt at once; returns each request's deltas."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    deltas = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return [deltas[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 16}, {"max_num_batched_tokens": 5, "max_num_seqs": 3}],
    ids=["batched", "chunked", "small_chunks"],
)
def test_prompt_logprobs_equal_transformers(checkpoint, hf_model, prompts, engine_args):
    engine = make_engine(checkpoint, **engine_args)
    for prompt, deltas in zip(prompts, run(engine, prompts, scoring()), strict=True):
        # The first delta carries them all, and no other delta does.
        assert [d.prompt_logprobs is not None for d in deltas] == [True, False]
        assert_matches_reference(deltas[0].prompt_logprobs, hf_model, prompt)


def test_prefix_cache_hits_are_recomputed_for_prompt_logprobs(checkpoint, hf_model, prompts):
    engine = make_engine(checkpoint)
    prompt = prompts[-1]  # 64 tokens: 4 full blocks
    [warm] = run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=1))
    hits_before = engine.stats().prefix_cache_hits
    [scored] = run(engine, [prompt], scoring())
    assert scored[0].num_cached_tokens == 0
    assert engine.stats().prefix_cache_hits == hits_before
    assert_matches_reference(scored[0].prompt_logprobs, hf_model, prompt)
    # Its blocks are still shared with a request that does not score its prompt.
    [after] = run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert after[0].num_cached_tokens == 63  # 3 blocks by hash, then the last one as a tail
    assert after[0].new_token_ids == warm[0].new_token_ids


def test_preempted_mid_prompt_scores_every_position_once(checkpoint, hf_model, prompts):
    engine = make_engine(checkpoint, max_num_batched_tokens=16)
    prompt = prompts[-1]
    engine.add_request("a", prompt, scoring())
    engine.step()  # the first chunk: positions 0..15 scored
    [request] = engine.scheduler.running
    assert request.num_scored_prompt_tokens == len(request.prompt_logprobs) == 16
    engine.scheduler._preempt(request)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    # Readmitted, it takes the one block it had scored from the cache and scores the rest.
    assert request.num_preemptions == 1 and request.prompt_logprobs == []  # sent, not kept
    assert engine.stats().prefix_cache_hits == 16
    assert_matches_reference(deltas[0].prompt_logprobs, hf_model, prompt)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(checkpoint, hf_model, prompts):
    engine = make_engine(checkpoint, max_num_batched_tokens=16)
    free_blocks = engine.scheduler.kv.num_free_blocks
    results = run(engine, prompts, scoring(max_tokens=0))
    for prompt, [delta] in zip(prompts, results, strict=True):
        assert delta.new_token_ids == []
        assert delta.finish_reason == FinishReason.LENGTH
        assert_matches_reference(delta.prompt_logprobs, hf_model, prompt)
    assert engine.scheduler.kv.num_free_blocks == free_blocks
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_do_not_change_the_generated_tokens(checkpoint, prompts):
    engine = make_engine(checkpoint)
    plain = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4))
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, prompt_logprobs=0)
    scored = run(engine, prompts, params)
    tokens = [[t for d in deltas for t in d.new_token_ids] for deltas in plain]
    assert [[t for d in deltas for t in d.new_token_ids] for deltas in scored] == tokens
    assert all(e.top_token_ids == [] for d in scored for e in d[0].prompt_logprobs)
