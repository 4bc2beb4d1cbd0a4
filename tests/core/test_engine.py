"""The core engine alone (the portable paths) against transformers: the same greedy tokens
through every scheduling path (batched, chunked, cached, preempted)."""

import random

import pytest
import torch
import transformers
from tiny_checkpoints import ARCHITECTURES, make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import FinishReason
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine

PROMPT_LENGTHS = [1, 3, 5, 9, 16, 17, 31, 40, 64]
NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """transformers' greedy continuations, one prompt at a time, no padding."""
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


def greedy(n=NUM_NEW_TOKENS):
    # min_tokens = max_tokens: EOS is masked like transformers' min_new_tokens does.
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def run_to_completion(engine, prompts, params):
    """Submit every prompt at once; `params` is one SamplingParams or one per prompt."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    tokens = {str(i): [] for i in range(len(prompts))}
    for i, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, request_params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def make_engine(checkpoint, **overrides):
    args = {"model": str(checkpoint), "dtype": "float32", "device": "cpu", "max_model_len": 128}
    args.update(overrides)
    return Engine(EngineConfig(**args))


ENGINE_PATHS = {
    "default": {},
    "few_seqs": {"max_num_seqs": 3},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 10, "max_num_seqs": 8},
}


@pytest.mark.parametrize("path", ENGINE_PATHS)
def test_batched_greedy_equals_transformers(checkpoint, prompts, reference, path):
    engine = make_engine(checkpoint, **ENGINE_PATHS[path])
    assert run_to_completion(engine, prompts, greedy()) == reference
    stats = engine.stats()
    if path == "preemption":
        assert stats.num_preemptions_total > 0
    assert stats.kv_cache_usage == 0.0
    engine.scheduler.kv.pool.check_invariants()


def test_one_at_a_time_equals_transformers(checkpoint, prompts, reference):
    engine = make_engine(checkpoint)
    for prompt, expected in zip(prompts, reference, strict=True):
        assert run_to_completion(engine, [prompt], greedy()) == [expected]


def test_prefix_cache_hits_give_the_same_tokens(checkpoint, prompts, reference):
    engine = make_engine(checkpoint, block_size=4)
    first = run_to_completion(engine, prompts, greedy())
    again = run_to_completion(engine, prompts, greedy())  # every prompt now fully cached
    assert first == again == reference
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("abort_after_steps", [0, 1, 3])
def test_abort_mid_prefill_and_mid_decode_frees_every_block(checkpoint, prompts, abort_after_steps):
    engine = make_engine(checkpoint, max_num_batched_tokens=16, block_size=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(50))
    for _ in range(abort_after_steps):
        engine.step()
    engine.abort([str(i) for i in range(len(prompts))])
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == engine.kv_cache.num_blocks
    engine.scheduler.kv.pool.check_invariants()


def test_eos_stops_unless_ignored(checkpoint):
    engine = make_engine(checkpoint)
    eos = next(iter(engine.eos_token_ids))
    # Bias EOS to be certain, then check both behaviours.
    stop = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={eos: 100.0})
    ignore = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={eos: 100.0}, ignore_eos=True)
    engine.add_request("stop", [1, 2, 3], stop)
    engine.add_request("ignore", [1, 2, 3], ignore)
    finished = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finish_reason is not None:
                finished[delta.request_id] = delta.finish_reason
    assert finished == {"stop": FinishReason.STOP, "ignore": FinishReason.LENGTH}


def test_seeded_request_is_independent_of_batch_neighbours(checkpoint):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10)
    alone = run_to_completion(make_engine(checkpoint), [[5, 6, 7]], params)[0]
    engine = make_engine(checkpoint)
    crowd = [[5, 6, 7]] + [[i, i + 1] for i in range(6)]
    neighbours = [SamplingParams(temperature=1.0, max_tokens=10)] * 6
    with_neighbours = run_to_completion(engine, crowd, [params] + neighbours)[0]
    assert alone == with_neighbours


def test_model_max_len_is_lowered_to_what_the_kv_cache_holds(checkpoint):
    # The tiny checkpoints have 512 positions; 10 blocks of 16 tokens hold 160.
    engine = Engine(EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=10))
    assert engine.max_model_len == 160
    assert engine.scheduler.config.max_model_len == 160
    with pytest.raises(ValueError, match=r"holds 160 tokens, fewer than max_model_len \(512\)"):
        Engine(
            EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=10, max_model_len=512)
        )
