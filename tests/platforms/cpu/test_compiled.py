"""The compiled CPU attention backend (compile_decode=True) against the eager one."""

import random

import pytest
import torch
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.attention.eager import paged_attention
from nanoserve.core.attention.metadata import build_attention_metadata
from nanoserve.core.engine import Engine
from nanoserve.platforms.cpu.attention import CpuKernelAttention
from nanoserve.platforms.cpu.compiled import CompiledCpuAttention, decode_attention


def test_decode_attention_matches_eager():
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    k_cache = torch.randn(20, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    seq_lens = [1, 7, 13]  # one request inside its first block, others spanning blocks
    block_tables = [[3], [5, 1], [2, 9, 11, 4]]
    meta = build_attention_metadata(
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

    def run(eager: bool, batch: list[list[int]]) -> list[list[int]]:
        engine = Engine(
            EngineConfig(
                model=str(checkpoint),
                dtype="float32",
                device="cpu",
                max_model_len=128,
                compile_decode=not eager,
            )
        )
        assert (engine.runner.compiled_model is None) == eager
        backend = CpuKernelAttention if eager else CompiledCpuAttention
        assert type(engine.runner.attention_backend) is backend
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
        for i, prompt in enumerate(batch):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
        return [tokens[str(i)] for i in range(len(batch))]

    # One request alone (one-token linears) and three at once (batched decode).
    for batch in (prompts[:1], prompts):
        assert run(False, batch) == run(True, batch)
