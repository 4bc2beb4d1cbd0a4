"""The reference attention backend (and the CPU one, whose decodes take our C++ kernel) against
attention written out the long way, in float64."""

import math
import random

import pytest
import torch

from nanoserve.core.attention.reference import ReferenceAttention, build_reference_metadata
from nanoserve.core.step_layout import StepLayout
from nanoserve.platforms.cpu.attention import (
    SHORT_CHUNK_TOKENS,
    CpuKernelAttention,
    with_token_contexts,
)
from nanoserve.platforms.cpu.kernels import load_cpu_kernels

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 4, 2, 8


def naive_attention(query, keys, values, query_positions, scale):
    """query [Q, H, D]; keys/values [K, Hkv, D] of positions 0..K-1; causal by position."""
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.zeros(query.shape, dtype=torch.float64)
    for qi, position in enumerate(query_positions):
        for head in range(NUM_HEADS):
            kv_head = head // group
            scores = [
                float(query[qi, head].double() @ keys[j, kv_head].double()) * scale
                for j in range(position + 1)
            ]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j, w in enumerate(weights):
                out[qi, head] += w / total * values[j, kv_head].double()
    return out


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_steps_match_naive_attention(seed, backend):
    """Decodes, fresh prompts, chunks after a cached prefix and fully cached prompts, mixed."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)

    # (tokens already in the cache, tokens run now): decodes have 1 new token.
    shapes = [(rng.randrange(1, 20), 1) for _ in range(rng.randrange(0, 3))]
    shapes += [
        (rng.choice([0, 4, 7, 12]), rng.randrange(2, 11)) for _ in range(rng.randrange(1, 4))
    ]
    if seed % 2:  # a chunk longer than the CPU backend's short ones, but few pairs: the kernel
        shapes.append((rng.choice([0, 5]), SHORT_CHUNK_TOKENS + 3))
    if seed == 3:  # one whose tokens see more keys than the kernel takes: SDPA over the context
        shapes.append((0, 91))  # 91 * 92 / 2 pairs > TOKEN_BY_TOKEN_PAIRS
    query_lens, seq_lens, tables, slots = [], [], [], []
    full_keys, full_values, query_positions = [], [], []
    for num_cached, num_new in shapes:
        total = num_cached + num_new
        blocks = [free_blocks.pop() for _ in range(-(-total // BLOCK_SIZE))]
        keys = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
        values = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
        for position in range(num_cached):  # the cached prefix is already in the pool
            block, offset = blocks[position // BLOCK_SIZE], position % BLOCK_SIZE
            k_cache[block, offset], v_cache[block, offset] = keys[position], values[position]
        query_lens.append(num_new)
        seq_lens.append(total)
        tables.append(blocks)
        slots += [
            blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_cached, total)
        ]
        full_keys.append(keys)
        full_values.append(values)
        query_positions.append(list(range(num_cached, total)))

    meta = build_reference_metadata(query_lens, seq_lens, tables, slots, BLOCK_SIZE, "cpu")
    new_k = torch.cat([k[len(k) - n :] for k, n in zip(full_keys, query_lens, strict=True)])
    new_v = torch.cat([v[len(v) - n :] for v, n in zip(full_values, query_lens, strict=True)])
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM)
    attention = (
        ReferenceAttention() if backend == "reference" else CpuKernelAttention(load_cpu_kernels())
    )
    if backend == "cpu":  # as its build_metadata gives it: short chunks' tokens as decodes
        meta = with_token_contexts(meta, StepLayout(query_lens=query_lens, seq_lens=seq_lens))
        assert (meta.token_contexts is None) == (seed == 3)
    got = attention.forward(query, new_k, new_v, k_cache, v_cache, meta, 0.35)

    start = 0
    for keys, values, positions in zip(full_keys, full_values, query_positions, strict=True):
        expected = naive_attention(
            query[start : start + len(positions)], keys, values, positions, 0.35
        )
        torch.testing.assert_close(
            got[start : start + len(positions)].double(), expected, atol=1e-5, rtol=1e-5
        )
        start += len(positions)


def test_mixed_step_is_split_into_decode_and_prompt_parts():
    meta = build_reference_metadata(
        [1, 1, 5], [6, 3, 5], [[0, 1], [2], [3, 4]], [5, 10, 12, 13, 14, 15, 16], BLOCK_SIZE, "cpu"
    )
    decode, prompt = meta.parts
    assert meta.num_decode_tokens == 2
    assert decode.is_decode_only and decode.decode_mask.shape == (2, 1, 1, 2 * BLOCK_SIZE)
    assert not prompt.is_decode_only and prompt.prompt_masks == [None]  # fresh prompt: causal
