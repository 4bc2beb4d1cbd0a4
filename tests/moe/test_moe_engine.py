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
