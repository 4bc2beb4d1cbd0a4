"""What a CUDA GPU puts into the core, chosen once for an engine.

attention      the Triton kernels (`attention.py`, `kernels/`), where Triton is installed and
               blocks hold at least 16 tokens (else the reference backend, with a warning)
KV budget      `gpu_memory_utilization` of the GPU minus the weights and the peak of a
               full-size profiling forward pass
step runners   decode steps replayed as CUDA graphs (`cuda_graphs.py`), unless
               `--enforce-eager`, which keeps the Triton kernels (as vLLM keeps its backend)
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from nanoserve.common.config import CacheConfig, EngineConfig, SchedulerConfig
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.attention.reference import ReferenceAttention
from nanoserve.core.fast_paths import FastPaths
from nanoserve.core.kv_cache import KVCache
from nanoserve.core.model_runner import StepRunner
from nanoserve.core.models.base import CausalLM
from nanoserve.core.step_layout import StepLayout

logger = logging.getLogger("nanoserve.cuda")

TRITON_MIN_BLOCK_SIZE = 16  # tl.dot multiplies tiles of at least 16 along every dimension


def triton_usable(block_size: int) -> bool:
    return block_size >= TRITON_MIN_BLOCK_SIZE and importlib.util.find_spec("triton") is not None


class CudaPaths:
    """The GPU's fast paths for one engine."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.device = device
        self.block_size = config.block_size
        self.use_triton = triton_usable(config.block_size)
        self.use_graphs = self.use_triton and not config.enforce_eager
        if not self.use_triton:
            logger.warning(
                "CUDA without the Triton backend (triton not installed, or block_size %d < %d): "
                "attention runs the reference torch path",
                config.block_size,
                TRITON_MIN_BLOCK_SIZE,
            )

    def attention_backend(self, model: CausalLM) -> AttentionBackend:
        if not self.use_triton:
            return ReferenceAttention()
        from nanoserve.platforms.cuda.attention import TritonAttention  # imports triton

        num_kv_heads = model.attention_layers()[0].num_kv_heads
        return TritonAttention(num_kv_heads)

    def step_runners(
        self, model: CausalLM, eager: StepRunner, limits: SchedulerConfig
    ) -> list[StepRunner]:
        if not self.use_graphs:
            return [eager]
        from nanoserve.platforms.cuda.cuda_graphs import CudaGraphRunner

        graphs = CudaGraphRunner(
            model, limits.max_num_seqs, limits.max_model_len, self.block_size, self.device
        )
        graphs.capture()
        return [graphs, eager]


def cuda_kv_cache_budget(
    model: CausalLM, kv_cache: KVCache, cache_config: CacheConfig, limits: SchedulerConfig
) -> int:
    """GPU memory left for KV after the weights and a full-size forward's activations."""
    device, utilization = kv_cache.device, cache_config.gpu_memory_utilization
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(model, kv_cache, limits.max_num_batched_tokens)
    peak = torch.cuda.max_memory_allocated(device)
    _, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - peak
    if budget <= 0:
        raise ValueError(
            f"the weights and a forward pass of {limits.max_num_batched_tokens} tokens take "
            f"{peak / 2**30:.2f} GiB, more than gpu_memory_utilization ({utilization}) of "
            f"the GPU's {total / 2**30:.1f} GiB; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens"
        )
    return budget


def profile_forward(model: CausalLM, kv_cache: KVCache, num_tokens: int) -> None:
    """Run the model once on `num_tokens` tokens with a throwaway cache to find peak memory."""
    block_size, device = kv_cache.block_size, kv_cache.device
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, kv_cache.num_kv_heads, kv_cache.head_dim)
    for layer in kv_cache.layers:
        k_cache = torch.zeros(shape, dtype=kv_cache.dtype, device=device)
        layer.bind(k_cache, torch.zeros_like(k_cache), kv_cache.backend)
    layout = StepLayout(
        query_lens=[num_tokens],
        seq_lens=[num_tokens],
        block_tables=[list(range(num_blocks))],
        slot_mapping=list(range(num_tokens)),
    )
    meta = kv_cache.backend.build_metadata(layout, block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(num_tokens, device=device), meta)
        model.compute_logits(hidden[-1:])
    for layer in kv_cache.layers:
        layer.bind(None, None, kv_cache.backend)
    torch.cuda.synchronize(device)


def cuda_fast_paths(config: EngineConfig, device: torch.device) -> FastPaths:
    """The GPU's fast paths for an engine of `config` on `device`."""
    paths = CudaPaths(config, device)
    return FastPaths(
        attention_backend=paths.attention_backend,
        kv_cache_budget=cuda_kv_cache_budget,
        step_runners=paths.step_runners,
    )
