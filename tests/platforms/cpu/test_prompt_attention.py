"""The prompt-attention kernel (csrc/prompt_attention.cpp): one prompt chunk over its context,
causal aligned to the last key, against float32 attention over the same bf16 inputs; with its
products on AVX-512 BF16 ("vectors") and on AMX's tiles, each where the CPU has them."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.cpu_features import has_amx_bf16, has_avx512_bf16
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.attention.reference import build_reference_metadata
from nanoserve.engine_setup import build_engine
from nanoserve.platforms.cpu.attention import CpuKernelAttention

CPU_HAS_AMX = has_amx_bf16()
CPU_HAS_AVX512_BF16 = has_avx512_bf16()
needs_amx = pytest.mark.skipif(not CPU_HAS_AMX, reason="this CPU has no AMX (bf16 tiles)")
needs_bf16 = pytest.mark.skipif(not CPU_HAS_AVX512_BF16, reason="this CPU has no AVX-512 BF16")


@pytest.fixture(
    params=[
        pytest.param(False, marks=needs_bf16, id="vectors"),
        pytest.param(True, marks=needs_amx, id="tiles"),
    ]
)
def allow_tiles(request):
    return request.param


def reference(query, key, value, scale):  # float32 attention, the causal mask bottom-right
    num_queries, num_keys = query.shape[0], key.shape[0]
    mask = torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries)
    out = F.scaled_dot_product_attention(
        *(t.float().transpose(0, 1)[None] for t in (query, key, value)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)  # [Q, H, D]


def chunk(num_queries, num_keys, heads, kv_heads, head_dim, seed=0):
    torch.manual_seed(seed)
    query = torch.randn(num_queries, heads, head_dim, dtype=torch.bfloat16)
    key = torch.randn(num_keys, kv_heads, head_dim, dtype=torch.bfloat16)
    return query, key, torch.randn_like(key)


def test_the_kernel_is_there_wherever_the_cpu_has_bf16_products(kernels):
    assert kernels.prompt_attention_is_available() == CPU_HAS_AVX512_BF16
    assert kernels.prompt_attention_uses_tiles() == CPU_HAS_AMX


@pytest.mark.parametrize(
    ("num_queries", "num_keys"),
    [
        (300, 300),  # a whole prompt: query blocks of 128 and a partial one
        (70, 333),  # a chunk over a cached prefix
        (1, 5),  # one query
        (129, 129),  # one past a query block and a key block
        (128, 256),  # exactly whole blocks
        (40, 40),  # less than one block each
    ],
)
# Qwen3-0.6B's heads; Qwen3-30B-A3B's (8 query heads a KV head); a group of 4; no grouping.
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(16, 8, 128), (32, 4, 128), (4, 1, 64), (3, 3, 256)]
)
def test_the_kernel_is_float32_attention_within_bf16_rounding(
    kernels, allow_tiles, num_queries, num_keys, heads, kv_heads, head_dim
):
    query, key, value = chunk(num_queries, num_keys, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    expected = reference(query, key, value, scale)
    got = kernels.prompt_attention(query, key, value, scale, allow_tiles=allow_tiles)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    # SDPA's own bf16 kernel is as far from float32 as rounding its output makes it; so is ours
    # (its probabilities are bf16 too).
    sdpa_error = (reference(query, key, value, scale).bfloat16().float() - expected).abs().max()
    assert (got.float() - expected).abs().max() <= 2 * sdpa_error + 2e-3


def test_a_query_never_sees_a_later_key(kernels, allow_tiles):
    query, key, value = chunk(200, 200, 16, 8, 128)
    poisoned_key, poisoned_value = key.clone(), value.clone()
    poisoned_key[150:] = 30.0  # scores that would swamp every other key's
    poisoned_value[150:] = 1e4
    clean = kernels.prompt_attention(query, key, value, 0.1, allow_tiles=allow_tiles)
    poisoned = kernels.prompt_attention(
        query, poisoned_key, poisoned_value, 0.1, allow_tiles=allow_tiles
    )
    torch.testing.assert_close(poisoned[:150], clean[:150], atol=0, rtol=0)
    assert poisoned[150:].float().abs().max() > 100  # the later queries do see them


def test_scores_that_keep_growing_along_the_keys_stay_exact(kernels, allow_tiles):
    # Each key block's largest score passes the last one's by far more than the kernel's
    # headroom, so the running maximum moves (and the output is rescaled) block after block.
    query, key, value = chunk(260, 520, 8, 8, 64, seed=1)
    growth = torch.linspace(0.1, 12.0, 520)[:, None, None]  # [K, 1, 1]
    key = (query.float().mean(0, keepdim=True).expand(520, -1, -1) * growth).bfloat16()
    scale = 64**-0.5
    got = kernels.prompt_attention(query, key, value, scale, allow_tiles=allow_tiles)
    expected = reference(query, key, value, scale)
    sdpa_error = (expected.bfloat16().float() - expected).abs().max()
    assert (got.float() - expected).abs().max() <= 2 * sdpa_error + 2e-3


def test_queries_may_be_a_view_into_a_fused_projection(kernels, allow_tiles):
    qkv = torch.randn(90, 16 + 2 * 8, 128, dtype=torch.bfloat16)  # [T, H + 2 Hkv, D]
    query, key, value = qkv[:, :16], qkv[:, 16:24], qkv[:, 24:]
    got = kernels.prompt_attention(query, key, value, 0.09, allow_tiles=allow_tiles)
    contiguous = kernels.prompt_attention(
        query.contiguous(), key.contiguous(), value.contiguous(), 0.09, allow_tiles=allow_tiles
    )
    torch.testing.assert_close(got, contiguous, atol=0, rtol=0)


@needs_amx
def test_tiles_and_vectors_sum_the_same_products(kernels):
    query, key, value = chunk(300, 333, 16, 8, 128, seed=5)
    tiles = kernels.prompt_attention(query, key, value, 0.088)
    vectors = kernels.prompt_attention(query, key, value, 0.088, allow_tiles=False)
    # float32 sums in another order, then the same bf16 rounding of each output
    assert (tiles.float() - vectors.float()).abs().max() <= 2e-2
    assert (tiles != vectors).float().mean() < 0.05


@needs_bf16
def test_the_cpu_backend_takes_bf16_chunks_through_the_kernel(kernels):
    backend = CpuKernelAttention(kernels)
    assert backend.prompt_kernel
    query, key, value = chunk(50, 80, 16, 8, 128)
    mask = torch.ones(50, 80, dtype=torch.bool).tril(30)
    got = backend.attend_chunk(query, key, value, mask, 0.088)
    torch.testing.assert_close(
        got, kernels.prompt_attention(query, key, value, 0.088), atol=0, rtol=0
    )
    # float32 (the oracle's dtype) stays with SDPA, exactly the reference backend's result
    query32, key32, value32 = query.float(), key.float(), value.float()
    got32 = backend.attend_chunk(query32, key32, value32, mask, 0.088)
    expected32 = reference(query32, key32, value32, 0.088)
    torch.testing.assert_close(got32, expected32, atol=1e-5, rtol=1e-5)


@needs_bf16
def test_a_prompt_step_attends_through_the_kernel(kernels):
    """A step of two prompt chunks (one over a cached prefix) through the backend's forward."""
    block_size, kv_heads, head_dim = 16, 8, 128
    torch.manual_seed(3)
    k_cache = torch.randn(40, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    query_lens, seq_lens = [100, 60], [100, 160]
    tables = [list(range(0, 7)), list(range(10, 20))]
    slots = [b * block_size + i for b in tables[0] for i in range(block_size)][:100]
    slots += [b * block_size + i for b in tables[1] for i in range(block_size)][100:160]
    backend = CpuKernelAttention(kernels)
    meta = build_reference_metadata(query_lens, seq_lens, tables, slots, block_size, "cpu")
    q = torch.randn(160, 16, head_dim, dtype=torch.bfloat16)
    k, v = (
        torch.randn(160, kv_heads, head_dim, dtype=torch.bfloat16),
        torch.randn(160, kv_heads, head_dim, dtype=torch.bfloat16),
    )
    got = backend.forward(q, k, v, k_cache, v_cache, meta, 0.088)
    first = reference(q[:100], k[:100], v[:100], 0.088)
    context = [k_cache[b] for b in tables[1]]
    k_second = torch.cat(context).view(-1, kv_heads, head_dim)[:160]
    v_second = torch.cat([v_cache[b] for b in tables[1]]).view(-1, kv_heads, head_dim)[:160]
    second = reference(q[100:], k_second, v_second, 0.088)
    expected = torch.cat([first, second])
    assert (got.float() - expected).abs().max() <= 2 * (
        expected.bfloat16().float() - expected
    ).abs().max() + 2e-3


def test_the_kernel_splits_tasks_across_threads_without_changing_them(kernels, allow_tiles):
    query, key, value = chunk(300, 300, 16, 8, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.prompt_attention(query, key, value, 0.088, allow_tiles=allow_tiles)
        torch.set_num_threads(2)
        two = kernels.prompt_attention(query, key, value, 0.088, allow_tiles=allow_tiles)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


class CountingKernels:
    """The kernels module, counting its prompt_attention calls."""

    def __init__(self, kernels) -> None:
        self.kernels, self.prompt_calls = kernels, 0

    def __getattr__(self, name: str):
        return getattr(self.kernels, name)

    def prompt_attention(self, *args):
        self.prompt_calls += 1
        return self.kernels.prompt_attention(*args)


def greedy_with_logprobs(engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
            logprobs += [entry.logprob for entry in delta.logprobs or []]
    return tokens, logprobs


@needs_bf16
def test_a_bf16_engine_prefills_through_the_kernel_as_through_sdpa(kernels, tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")  # head_dim 32
    config = EngineConfig(model=str(checkpoint), dtype="bfloat16", device="cpu", max_model_len=256)
    with_kernel, with_sdpa = build_engine(config), build_engine(config)
    counting = CountingKernels(with_kernel.kv_cache.backend.kernels)
    with_kernel.kv_cache.backend.kernels = counting
    with_sdpa.kv_cache.backend.prompt_kernel = False
    prompt = [random.Random(4).randrange(0, 256) for _ in range(150)]  # 11,325 (token, key) pairs
    tokens, logprobs = greedy_with_logprobs(with_kernel, prompt)
    assert counting.prompt_calls == 2  # the prompt's step, once per layer
    sdpa_tokens, sdpa_logprobs = greedy_with_logprobs(with_sdpa, prompt)
    assert tokens == sdpa_tokens
    assert logprobs == pytest.approx(sdpa_logprobs, abs=0.02)
