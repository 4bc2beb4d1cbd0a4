"""Qwen3-MoE and Mixtral through the engine (this machine's fast paths, as served): the same
greedy tokens as transformers through every scheduling path, in float32, and within a stated
tolerance with int8 experts."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from tiny_checkpoints import MOE_ARCHITECTURES, make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.engine_setup import build_engine
from nanoserve.moe.int8 import Int8MoeMethod

PROMPT_LENGTHS = [1, 3, 9, 17, 31, 40]
NUM_NEW_TOKENS = 10
ENGINE_PATHS = {
    "batched": {},
    "few_seqs": {"max_num_seqs": 2},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 8, "max_num_seqs": 6},
}


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """transformers' greedy continuations, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def greedy(n: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def make_engine(checkpoint, **overrides):
    args = {"model": str(checkpoint), "dtype": "float32", "device": "cpu", "max_model_len": 128}
    args.update(overrides)
    return build_engine(EngineConfig(**args))


def run_to_completion(engine, prompts, params):
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_greedy_equals_transformers_through_every_path(checkpoint, prompts, reference, path):
    engine = make_engine(checkpoint, **ENGINE_PATHS[path])
    assert run_to_completion(engine, prompts, greedy()) == reference
    if path == "preemption":
        assert engine.stats().num_preemptions_total > 0
    engine.scheduler.kv.pool.check_invariants()


def test_prefix_cache_hits_give_the_same_tokens(checkpoint, prompts, reference):
    engine = make_engine(checkpoint, block_size=4)
    first = run_to_completion(engine, prompts, greedy())
    again = run_to_completion(engine, prompts, greedy())
    assert first == again == reference
    assert engine.stats().prefix_cache_hits > 0


# Max |logprob difference| of a generated token from transformers' float32 logprob of the same
# token after the same tokens, with int8 weights (experts and linears) and float32 activations
# (the tiny models reach 0.14 and 0.38).
INT8_LOGPROB_TOLERANCE = 0.5


def reference_logprobs(model, prompt: list[int], generated: list[int]) -> list[float]:
    """transformers' logprob of each generated token, given the prompt and those before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    chosen = logits.log_softmax(-1).gather(-1, torch.tensor(generated)[:, None])
    return chosen[:, 0].tolist()


@pytest.fixture(scope="module")
def int8_batched(checkpoint, prompts):
    """The int8 engine's greedy tokens and their logprobs on the plain batched path."""
    return run_scored(make_engine(checkpoint, quantization="int8"), prompts)


def run_scored(engine, prompts):
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS, logprobs=0
    )
    outputs: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            chosen = [entry.logprob for entry in delta.logprobs or []]
            outputs[delta.request_id].extend(zip(delta.new_token_ids, chosen, strict=True))
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_int8_weights_stay_within_tolerance_of_transformers_through_every_path(
    checkpoint, prompts, int8_batched, path
):
    engine = make_engine(checkpoint, quantization="int8", **ENGINE_PATHS[path])
    assert all(isinstance(b.method, Int8MoeMethod) for b in engine.model.moe_blocks())
    got = run_scored(engine, prompts)
    assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in int8_batched]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    differences = []
    for prompt, seq in zip(prompts, got, strict=True):
        expected = reference_logprobs(model, prompt, [t for t, _ in seq])
        differences += [abs(lp - ref) for (_, lp), ref in zip(seq, expected, strict=True)]
    assert 0 < max(differences) <= INT8_LOGPROB_TOLERANCE
    engine.scheduler.kv.pool.check_invariants()
