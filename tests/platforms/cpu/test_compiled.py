"""The compiled CPU decode path (compile_decode=True) against the reference attention and the
eager runner."""

import random

import pytest
import torch
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.attention.reference import build_reference_metadata, paged_attention
from nanoserve.engine_setup import build_engine
from nanoserve.platforms.cpu.attention import CpuKernelAttention
from nanoserve.platforms.cpu.compiled import CompiledCpuAttention, decode_attention


def test_decode_attention_matches_the_reference():
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    k_cache = torch.randn(20, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    seq_lens = [1, 7, 13]  # one request inside its first block, others spanning blocks
    block_tables = [[3], [5, 1], [2, 9, 11, 4]]
    meta = build_reference_metadata(
        [1, 1, 1], seq_lens, block_tables, [12, 6, 16], block_size, torch.device("cpu")
    )
    query = torch.randn(3, num_heads, head_dim)
    expected = paged_attention(query, k_cache, v_cache, meta, 0.3)
    got = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.3)
    torch.testing.assert_close(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen3", "qwen2"])
def test_compiled_decode_gives_the_plain_paths_tokens(tmp_path, architecture):
    checkpoint = make_tiny_checkpoint(tmp_path, architecture)
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)

    def build(eager: bool):
        engine = build_engine(
            EngineConfig(
                model=str(checkpoint),
                dtype="float32",
                device="cpu",
                max_model_len=128,
                compile_decode=not eager,
            )
        )
        names = [runner.name for runner in engine.runner.step_runners]
        plain = [["eager"], ["adaptive-threads(eager)"]]  # one thread, or several
        assert names in plain if eager else names == ["compiled-decode", "eager"]
        backend = CpuKernelAttention if eager else CompiledCpuAttention
        assert type(engine.kv_cache.backend) is backend
        return engine

    def run(engine, batch: list[list[int]]) -> list[list[int]]:
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
        for i, prompt in enumerate(batch):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
        return [tokens[str(i)] for i in range(len(batch))]

    compiled, eager = build(eager=False), build(eager=True)
    # One request alone (one-token linears) and three at once (batched decode).
    for batch in (prompts[:1], prompts):
        assert run(compiled, batch) == run(eager, batch)


@pytest.mark.slow
@pytest.mark.parametrize("is_reset", [False, True])
def test_the_compiled_runner_leaves_nothing_to_compile_for_the_first_requests(tmp_path, is_reset):
    """Built, the compiled runner has its four decode graphs: decoding at batch sizes 1, 2 and 3,
    inside a context's first KV block and past it, compiles nothing more (with the compiled
    graphs thrown away, the first batch of the same requests does compile: the control, which
    shows that the count sees compiles, needs no more)."""
    from torch._dynamo.utils import counters

    model_dir = make_tiny_checkpoint(tmp_path, "qwen3")
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", compile_decode=True)
    engine = build_engine(config)
    if is_reset:
        torch._dynamo.reset()
    num_graphs = counters["stats"]["unique_graphs"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    batches = [[[5, 6]], [[7, 8], [9]], [[1] * 3, [2] * 20, [3] * 40]]
    for batch in batches[:1] if is_reset else batches:
        for i, prompt in enumerate(batch):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    num_new_graphs = counters["stats"]["unique_graphs"] - num_graphs
    assert (num_new_graphs > 0) == is_reset, num_new_graphs
