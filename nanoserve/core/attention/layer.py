"""The attention layer the model calls, and the interface every attention backend implements:
the metadata it needs for a step (built once per step, shared by every layer) and the kernel
that writes the step's keys and values into a layer's paged cache and attends over it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from nanoserve.core.step_layout import StepLayout


class AttentionBackend:
    """Builds a step's attention metadata; writes a layer's keys and values, then attends."""

    name = "abstract"
    kv_cache_dtype: torch.dtype | None = None  # what the pool stores (None: the model's dtype)

    def for_layer(self, index: int) -> AttentionBackend:
        """The backend layer `index` is bound to: this one, unless it keeps per-layer state."""
        return self

    def build_metadata(self, layout: StepLayout, block_size: int, device: torch.device) -> Any:
        """This backend's metadata of one step, from the step's flat batch."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: Any,  # what build_metadata returned for this step
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        raise NotImplementedError


class PagedAttention(nn.Module):
    """Attention over the paged KV cache.

    The engine binds `k_cache`, `v_cache` and `backend` after allocating the pool (`bind`);
    until then calling the layer is an error."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def bind(
        self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, backend: AttentionBackend
    ) -> None:
        """Give the layer its slice of the KV pool and the backend that reads and writes it."""
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        meta: Any,  # the step's metadata, built by the bound backend
    ) -> torch.Tensor:  # [T, H, D]
        assert self.backend is not None and self.k_cache is not None and self.v_cache is not None, (
            "KV cache not bound: the engine binds it after allocating the pool"
        )
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
