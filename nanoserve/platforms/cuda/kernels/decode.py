"""Paged decode attention, split along the context (flash-decoding), grouped by KV head.

One query token per request. The grid is (request, KV head, split): a program loads the queries
of every head that shares its KV head (GQA: they read the same keys and values once), walks its
share of the request's blocks with an online softmax, and writes an unnormalised partial result
with its running max and sum. A second kernel merges the splits of each (request, head). Long
contexts thus spread over many programs even when the batch is small, and the grid depends only
on the batch size and `num_splits`, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.platforms.cuda.kernels import fp32_products
from nanoserve.platforms.cuda.kernels.online_softmax import attend_tile, load_kv_tile

MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 32
TARGET_PROGRAMS = 256  # enough programs to keep a large GPU busy


def num_decode_splits(num_requests: int, num_kv_heads: int, max_blocks: int) -> int:
    """How many parts to split each context into: a power of two, more for few long contexts."""
    wanted = triton.cdiv(TARGET_PROGRAMS, max(1, num_requests * num_kv_heads))
    useful = triton.cdiv(max_blocks, MIN_BLOCKS_PER_SPLIT)
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, min(wanted, useful))))


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    partial_out_ptr,  # [B, H, S, D] float32, unnormalised
    partial_max_ptr,  # [B, H, S] float32
    partial_sum_ptr,  # [B, H, S] float32
    scale,
    q_stride_b,
    q_stride_h,
    table_stride_b,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    blocks_per_split,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two ≥ 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two ≥ 16
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    NUM_SPLITS: tl.constexpr,
    FP32_PRODUCTS: tl.constexpr,  # exact float32 tile products (see fp32_products)
):
    request, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + request)
    first_block = split * blocks_per_split
    last_block = tl.minimum(first_block + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))
    g, d, t = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g  # [BLOCK_G]: the query heads of this KV head
    g_mask, d_mask = g < GROUP, d < HEAD_DIM
    mask = g_mask[:, None] & d_mask[None, :]  # [BLOCK_G, BLOCK_D]
    q_offsets = request * q_stride_b + heads[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=mask, other=0.0)
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum, acc = tl.zeros([BLOCK_G], tl.float32), tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + request * table_stride_b  # this request's block table
    for block in range(first_block, last_block):
        k, v = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            tl.zeros([BLOCK_SIZE], tl.int64) + tl.load(table + block),  # the block's id
            t,
            kv_head,
            d,
            tl.broadcast_to(d_mask[None, :], (BLOCK_SIZE, BLOCK_D)),
            cache_stride_block,
            cache_stride_token,
            cache_stride_head,
        )
        visible = (block * BLOCK_SIZE + t)[None, :] < seq_len  # [1, BLOCK_SIZE]
        running_max, running_sum, acc = attend_tile(
            q, k, v, visible, scale, running_max, running_sum, acc, FP32_PRODUCTS
        )
    partial = (request * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # [BLOCK_G]
    tl.store(partial_max_ptr + partial, running_max, mask=g_mask)
    tl.store(partial_sum_ptr + partial, running_sum, mask=g_mask)
    tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [B, H, S, D] float32
    partial_max_ptr,  # [B, H, S] float32
    partial_sum_ptr,  # [B, H, S] float32
    out_ptr,  # [B, H, D]
    out_stride_b,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = (request * tl.num_programs(1) + head) * NUM_SPLITS
    maxes = tl.load(partial_max_ptr + base + s)  # [S]; -inf for splits past the context
    sums = tl.load(partial_sum_ptr + base + s)
    outs = tl.load(
        partial_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=d_mask[None, :]
    )  # [S, BLOCK_D]
    overall_max = tl.max(maxes, axis=0)
    weights = tl.where(maxes > float("-inf"), tl.exp(maxes - overall_max), 0.0)  # [S]
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(weights[:, None] * outs, axis=0) / total  # [BLOCK_D]
    out_offsets = request * out_stride_b + head * out_stride_h + d
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] int, each ≥ 1
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [B, H, D]: where to write (tests pass NaN-filled ones)
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per request over its paged context (flash-decoding)."""
    num_requests, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    partial_out = query.new_empty(
        num_requests, num_heads, num_splits, head_dim, dtype=torch.float32
    )
    partial_max = query.new_empty(num_requests, num_heads, num_splits, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(num_requests, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_max,
        partial_sum,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        triton.cdiv(max_blocks, num_splits),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        FP32_PRODUCTS=fp32_products(query.dtype),
    )
    out = torch.empty_like(query) if out is None else out
    _merge_splits_kernel[(num_requests, num_heads)](
        partial_out,
        partial_max,
        partial_sum,
        out,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
    )
    return out
