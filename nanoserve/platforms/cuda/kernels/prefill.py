"""Attention for a ragged batch of queries over their paged contexts (flash attention).

Each request brings `query_len` new tokens at the end of its `seq_len`-token context: a fresh
prompt (query_len == seq_len), a chunk after a cached prefix or earlier chunks, or one decode
token. The new keys and values are already in the cache (the backend writes them first), so
every key is read the same way, through the block table. The grid is (query tile, request,
head); a program walks the keys its tile may see (causal: up to its last query's position)
with an online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.platforms.cuda.kernels import fp32_products
from nanoserve.platforms.cuda.kernels.online_softmax import attend_tile, load_kv_tile

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # keys per inner step


@triton.jit
def _causal_tile(
    q,  # [BLOCK_M, BLOCK_D]
    query_positions,  # [BLOCK_M]: each query's position in its sequence
    last_key,  # keys at positions < last_key may be seen by some query of the tile
    table,  # the request's block table
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    d,
    d_mask,
    scale,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_PRODUCTS: tl.constexpr,
):
    """Causal attention of a tile of queries over keys [0, last_key): [BLOCK_M, BLOCK_D]."""
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_start in range(0, last_key, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)  # key positions
        n_mask = n < last_key
        block_ids = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0)
        k, v = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_ids,
            n % BLOCK_SIZE,
            kv_head,
            d,
            n_mask[:, None] & d_mask[None, :],
            cache_stride_block,
            cache_stride_token,
            cache_stride_head,
        )
        visible = (n[None, :] <= query_positions[:, None]) & n_mask[None, :]
        running_max, running_sum, acc = attend_tile(
            q, k, v, visible, scale, running_max, running_sum, acc, FP32_PRODUCTS
        )
    return acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    query_start_loc_ptr,  # [B + 1]: where each request's queries start in the flat batch
    seq_lens_ptr,  # [B]: context length after this step
    block_tables_ptr,  # [B, max_blocks]
    scale,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    table_stride_b,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_PRODUCTS: tl.constexpr,  # exact float32 tile products (see fp32_products)
):
    tile, request, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    if tile * BLOCK_M < query_len:
        seq_len = tl.load(seq_lens_ptr + request)
        context_len = seq_len - query_len  # keys cached before this step
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request
        d = tl.arange(0, BLOCK_D)
        mask = (m < query_len)[:, None] & (d < HEAD_DIM)[None, :]  # [BLOCK_M, BLOCK_D]
        q_offsets = (query_start + m)[:, None] * q_stride_t + head * q_stride_h + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=mask, other=0.0)
        last_key = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)  # causal limit
        out = _causal_tile(
            q,
            context_len + m,
            last_key,
            block_tables_ptr + request * table_stride_b,  # this request's block table
            k_cache_ptr,
            v_cache_ptr,
            head // GROUP,  # its KV head
            d,
            d < HEAD_DIM,
            scale,
            cache_stride_block,
            cache_stride_token,
            cache_stride_head,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            FP32_PRODUCTS,
        )
        out_offsets = (query_start + m)[:, None] * out_stride_t + head * out_stride_h + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def ragged_prefill_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int
    block_tables: torch.Tensor,  # [B, max_blocks] int
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [T, H, D]: where to write (tests pass NaN-filled ones)
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of every new token over its request's cached and new keys."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_requests = seq_lens.shape[0]
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty_like(query) if out is None else out
    grid = (triton.cdiv(max_query_len, BLOCK_M), num_requests, num_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        FP32_PRODUCTS=fp32_products(query.dtype),
    )
    return out
