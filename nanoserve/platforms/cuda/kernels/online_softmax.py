"""Flash attention's inner step, shared by the decode and prefill kernels.

Attention over a long context is computed one tile of keys at a time, never materialising all
scores: each row keeps its running max of scores, the sum of exp(score - max) so far, and the
output accumulated with the same weights. A new tile raises the max where it must and rescales
what was accumulated by exp(old max - new max) (Milakov & Gimelshein's online softmax).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q,  # [M, D]: the queries
    k,  # [N, D]: a tile of keys
    v,  # [N, D]: and their values
    visible,  # [M, N] bool: which keys each query sees
    scale,
    running_max,  # [M] float32
    running_sum,  # [M] float32
    acc,  # [M, D] float32, unnormalised
    FP32_PRODUCTS: tl.constexpr,
):
    """Fold one tile of keys into (running_max, running_sum, acc); returns the three updated."""
    k, v = k.to(q.dtype), v.to(q.dtype)  # an FP8 cache widens here (no-op otherwise)
    if FP32_PRODUCTS:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))  # [M, N] float32
    scores = tl.where(visible, scores * scale, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    new_max = tl.where(new_max > float("-inf"), new_max, 0.0)  # rows that see no key stay finite
    probs = tl.exp(scores - new_max[:, None])
    correction = tl.exp(running_max - new_max)
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    if FP32_PRODUCTS:
        update = tl.dot(probs, v.to(tl.float32), input_precision="ieee")
    else:
        update = tl.dot(probs.to(v.dtype), v)
    return new_max, running_sum, acc * correction[:, None] + update


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_ids,  # [N]: the block of each key position
    offsets_in_block,  # [N]: its slot within the block
    kv_head,
    d,  # [BLOCK_D]: head-dim offsets
    mask,  # [N, BLOCK_D]
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
):
    """The keys and values of N positions of one KV head, read through the block table."""
    offsets = (
        block_ids[:, None] * cache_stride_block
        + offsets_in_block[:, None] * cache_stride_token
        + kv_head * cache_stride_head
        + d[None, :]
    )  # [N, BLOCK_D]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    return k, v
