"""The KV cache's tensors: how many blocks fit the memory budget, and allocating them.

The pool is, per layer, a K and a V tensor [num_blocks, block_size, Hkv, D]; the block
bookkeeping (who owns which block, prefix hashes) is `kv_cache_manager.py`'s. The budget is
`kv_cache_memory` bytes (default: up to 2 GiB, never more than every sequence at full length),
unless a platform measures its own (`FastPaths.kv_cache_budget`: on CUDA, a share of the GPU's
memory minus the weights and a profiling forward pass), and how its zeros are allocated
(`FastPaths.kv_cache_zeros`: on CPU the OS zeroes pages as they are first written).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from nanoserve.common.config import CacheConfig, SchedulerConfig
from nanoserve.core.attention.layer import AttentionBackend, PagedAttention
from nanoserve.core.parallel import TensorParallel

logger = logging.getLogger("nanoserve.kv_cache")

DEFAULT_KV_CACHE_BYTES = 2 << 30


# Allocates zeros of (shape, dtype, device): the pool's memory.
Zeros = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def portable_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """Sizes the KV pool, allocates it and binds each layer's K and V to its attention."""

    def __init__(
        self,
        layers: list[PagedAttention],
        backend: AttentionBackend,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
        zeros: Zeros = portable_zeros,
    ) -> None:
        self.layers = layers  # every layer's attention, in order
        self.zeros = zeros
        self.tp = tp or TensorParallel()
        self.backend = backend
        self.block_size = block_size
        self.dtype = backend.kv_cache_dtype or dtype  # a quantized cache (fp8) is narrower
        self.device = device
        # This rank's KV heads (all of them without tensor parallelism).
        self.num_kv_heads, self.head_dim = layers[0].num_kv_heads, layers[0].head_dim
        self.num_blocks = 0
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (K, V)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: K and V, block_size slots, every KV head."""
        per_token = 2 * len(self.layers) * self.num_kv_heads * self.head_dim
        return per_token * self.block_size * torch.finfo(self.dtype).bits // 8

    def allocate(
        self,
        cache_config: CacheConfig,
        limits: SchedulerConfig,
        budget_bytes: int | None = None,
    ) -> None:
        """Size the pool (from `budget_bytes` when a platform measured it), allocate it and
        bind it to the layers."""
        self.num_blocks = self._num_blocks(cache_config, limits, budget_bytes)
        if self.tp.size > 1:  # every rank holds the same blocks: the smallest pool wins
            count = torch.tensor([self.num_blocks], device=self.device)
            torch.distributed.all_reduce(count, torch.distributed.ReduceOp.MIN, group=self.tp.group)
            self.num_blocks = int(count.item())
        self.tensors = [self._bind_new(i, layer) for i, layer in enumerate(self.layers)]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), up to %d tokens",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_bytes / 2**20,
            self.num_blocks * self.block_size,
        )

    def _bind_new(self, index: int, layer: PagedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """A zero-filled K and V for one layer, bound to it: separate tensors, since
        torch.compile updates a cache in place only when it aliases no other input; zeros, since
        unwritten slots are masked but 0 * NaN would still poison the attention output."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        k_cache = self.zeros(shape, self.dtype, self.device)
        v_cache = self.zeros(shape, self.dtype, self.device)
        layer.bind(k_cache, v_cache, self.backend.for_layer(index))
        return k_cache, v_cache

    def _num_blocks(
        self, cache_config: CacheConfig, limits: SchedulerConfig, budget_bytes: int | None
    ) -> int:
        if cache_config.num_blocks_override is not None:
            return cache_config.num_blocks_override
        budget = budget_bytes if budget_bytes is not None else cache_config.kv_cache_memory
        if budget is None:  # up to 2 GiB, and no more than every sequence at full length
            tokens = limits.max_num_seqs * limits.max_model_len + limits.max_num_batched_tokens
            needed_bytes = (tokens // self.block_size + 1) * self.block_bytes
            budget = min(DEFAULT_KV_CACHE_BYTES, needed_bytes)
        num_blocks = budget // self.block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds fewer than 2 blocks of "
                f"{self.block_size} tokens; give more kv_cache_memory (or gpu_memory_utilization)"
            )
        return num_blocks
