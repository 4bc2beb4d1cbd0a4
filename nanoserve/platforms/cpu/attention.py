"""The default CPU attention backend: the reference backend, with decode tokens attending through
our compiled paged-decode kernel (`csrc/decode_attention.cpp`, see `kernels.py`).

The reference path gathers every decode request's keys and values out of the paged cache, pads
them to the longest context and runs PyTorch's ops over the copies: at a decode step's sizes
that costs more in copies and dispatch than in arithmetic. The kernel reads each key and value
row where it lies in the cache, once for all the query heads that share it, in float32 (an FP8
cache's rows widened as they are read). Prompt tokens attend as in the reference backend.
"""

from __future__ import annotations

from types import ModuleType

import torch

from nanoserve.core.attention.reference import (
    ReferenceAttention,
    ReferenceMetadata,
    decode_group_attention,
)

KERNEL_DTYPES = (torch.bfloat16, torch.float32)


class CpuKernelAttention(ReferenceAttention):
    """Reference attention whose decode tokens take the compiled paged-decode kernel."""

    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def attend_decodes(
        self,
        query: torch.Tensor,  # [B, H, D]: one query token per request
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: ReferenceMetadata,
        scale: float,
    ) -> torch.Tensor:  # [B, H, D]
        if query.dtype not in KERNEL_DTYPES or query.device.type != "cpu":
            return decode_group_attention(query, k_cache, v_cache, meta, scale)
        return self.kernels.paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
        )
