"""The Triton attention backend, the default on CUDA.

Per layer and step: one kernel writes the new keys and values by slot, then either the
flash-decoding kernel (every request runs one token: the step CUDA graphs capture) or the ragged
flash-attention kernel (prompts, chunks after a cached prefix, and mixed steps) reads the paged
cache through the block tables. It needs none of the reference backend's masks or gather indices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.attention.metadata import AttentionMetadata
from nanoserve.platforms.cuda.kernels.decode import num_decode_splits, paged_decode_attention
from nanoserve.platforms.cuda.kernels.prefill import ragged_prefill_attention
from nanoserve.platforms.cuda.kernels.store_kv import store_kv

if TYPE_CHECKING:
    from nanoserve.core.step_layout import StepLayout


class TritonAttention(AttentionBackend):
    """Paged attention in three Triton kernels (see `kernels/`)."""

    name = "triton"

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads

    def build_metadata(
        self, layout: StepLayout, block_size: int, device: torch.device
    ) -> AttentionMetadata:
        """The shared fields are all the kernels read (slots, block tables, lengths)."""
        return AttentionMetadata.build(
            layout.query_lens, layout.seq_lens, layout.block_tables, layout.slot_mapping, device
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            num_requests, max_blocks = meta.block_tables.shape
            num_splits = num_decode_splits(num_requests, self.num_kv_heads, max_blocks)
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits
            )
        return ragged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            max(meta.query_lens_list),
        )
