"""The KV cache's tensors: how many blocks fit the memory budget, and allocating them.

The pool is, per layer, a K and a V tensor [num_blocks, block_size, Hkv, D]; the block
bookkeeping (who owns which block, prefix hashes) is `kv_cache_manager.py`'s. The budget is
`kv_cache_memory` bytes on CPU (default: up to 2 GiB, never more than every sequence at full
length), and on CUDA `gpu_memory_utilization` of the GPU minus the weights and the peak of a
full-size profiling forward pass.
"""

from __future__ import annotations

import logging

import torch

from nanoserve.common.config import CacheConfig, ModelConfig, SchedulerConfig
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.attention.metadata import build_attention_metadata
from nanoserve.core.models.llama import LlamaForCausalLM
from nanoserve.distributed.parallel import TensorParallel

logger = logging.getLogger("nanoserve.kv_cache")

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


class KVCache:
    """Sizes the KV pool, allocates it and binds each layer's K and V to its attention."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        self.model = model
        self.tp = tp or TensorParallel()
        self.model_config = model_config
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.dtype = next(model.parameters()).dtype
        attention = model.attention_layers()[0]  # this rank's heads (all, without parallelism)
        self.num_kv_heads, self.head_dim = attention.num_kv_heads, attention.head_dim
        self.num_blocks = 0
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (K, V)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: K and V, block_size slots, every KV head."""
        per_token = 2 * self.model_config.num_hidden_layers * self.num_kv_heads * self.head_dim
        return per_token * self.block_size * torch.finfo(self.dtype).bits // 8

    def allocate(self, cache_config: CacheConfig, limits: SchedulerConfig) -> None:
        """Size the pool from the budget, allocate it and bind it to the layers."""
        self.num_blocks = self._num_blocks(cache_config, limits)
        if self.tp.size > 1:  # every rank holds the same blocks: the smallest pool wins
            count = torch.tensor([self.num_blocks], device=self.device)
            torch.distributed.all_reduce(count, torch.distributed.ReduceOp.MIN, group=self.tp.group)
            self.num_blocks = int(count.item())
        self.tensors = [self._bind_new(layer) for layer in self.model.attention_layers()]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), up to %d tokens",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_bytes / 2**20,
            self.num_blocks * self.block_size,
        )

    def _bind_new(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """A zero-filled K and V for one layer, bound to it.

        Separate tensors rather than views of one: torch.compile updates a cache in place only
        when it aliases no other input. Zero-filled so that slots not yet written hold finite
        values (they are masked, but 0 * NaN would still poison the attention output).
        """
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # Fixed shapes: keeps torch.compile from tying a cache dim to an equal batch size.
        torch._dynamo.mark_static(k_cache)
        torch._dynamo.mark_static(v_cache)
        layer.bind(k_cache, v_cache, self.backend)
        return k_cache, v_cache

    def _num_blocks(self, cache_config: CacheConfig, limits: SchedulerConfig) -> int:
        if cache_config.num_blocks_override is not None:
            return cache_config.num_blocks_override
        if self.device.type == "cuda":
            budget = self._cuda_budget(
                cache_config.gpu_memory_utilization, limits.max_num_batched_tokens
            )
        else:
            budget = cache_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
            if cache_config.kv_cache_memory is None:
                # Without an explicit budget, take no more than every sequence at full length.
                needed_tokens = (
                    limits.max_num_seqs * limits.max_model_len + limits.max_num_batched_tokens
                )
                budget = min(budget, (needed_tokens // self.block_size + 1) * self.block_bytes)
        num_blocks = budget // self.block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds fewer than 2 blocks of "
                f"{self.block_size} tokens; give more kv_cache_memory (or gpu_memory_utilization)"
            )
        return num_blocks

    def _cuda_budget(self, utilization: float, max_num_batched_tokens: int) -> int:
        """GPU memory left for KV after weights and a full-size forward's activations."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward(max_num_batched_tokens)
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * utilization) - peak
        if budget <= 0:
            raise ValueError(
                f"the weights and a forward pass of {max_num_batched_tokens} tokens take "
                f"{peak / 2**30:.2f} GiB, more than gpu_memory_utilization ({utilization}) of "
                f"the GPU's {total / 2**30:.1f} GiB; raise --gpu-memory-utilization or lower "
                "--max-num-batched-tokens"
            )
        return budget

    def _profile_forward(self, num_tokens: int) -> None:
        """Run the model once on `num_tokens` tokens with a throwaway cache to find peak memory."""
        num_blocks = -(-num_tokens // self.block_size)
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        for layer in self.model.attention_layers():
            k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.bind(k_cache, torch.zeros_like(k_cache), self.backend)
        meta = build_attention_metadata(
            [num_tokens],
            [num_tokens],
            [list(range(num_blocks))],
            list(range(num_tokens)),
            self.block_size,
            self.device,
            eager_fields=self.backend.uses_eager_metadata,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta)
            self.model.compute_logits(hidden[-1:])
        for layer in self.model.attention_layers():
            layer.bind(None, None, self.backend)
        torch.cuda.synchronize(self.device)
