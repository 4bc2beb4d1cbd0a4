"""Write this step's keys and values into their slots of the paged KV cache.

The keys and values come in the cache's dtype: an FP8 cache's are quantized before
(`quantization/kv_cache_fp8.py`), so this is a copy of bytes whatever the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_slots, Hkv, D] (the cache viewed slot by slot)
    v_cache_ptr,
    slot_mapping_ptr,  # [T]; a negative slot means "pad row, write nothing"
    k_row_stride,  # elements between two tokens of k
    v_row_stride,  # elements between two tokens of v
    ROW_SIZE: tl.constexpr,  # Hkv * D
    BLOCK: tl.constexpr,  # ROW_SIZE rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        offsets = tl.arange(0, BLOCK)
        mask = offsets < ROW_SIZE
        key = tl.load(k_ptr + token * k_row_stride + offsets, mask=mask)
        value = tl.load(v_ptr + token * v_row_stride + offsets, mask=mask)
        tl.store(k_cache_ptr + slot * ROW_SIZE + offsets, key, mask=mask)
        tl.store(v_cache_ptr + slot * ROW_SIZE + offsets, value, mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset, or -1 (padding)
) -> None:
    """One program per token copies its Hkv * D keys and values into the pool."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)  # [T, Hkv * D]
    assert k.stride(1) == 1 and v.stride(1) == 1, "each token's keys and values are contiguous"
    row_size = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        ROW_SIZE=row_size,
        BLOCK=triton.next_power_of_2(row_size),
    )
