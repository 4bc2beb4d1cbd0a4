"""Which attention backend an engine uses: chosen once, by the model runner, for every layer."""

from __future__ import annotations

import importlib.util
import logging

import torch

from nanoserve.core.attention.eager import EagerAttention
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.platforms.cpu.attention import CpuKernelAttention
from nanoserve.platforms.cpu.compiled import CompiledCpuAttention
from nanoserve.platforms.cpu.kernels import load_cpu_kernels

logger = logging.getLogger("nanoserve.attention")

TRITON_MIN_BLOCK_SIZE = 16  # tl.dot multiplies tiles of at least 16 along every dimension


def select_attention_backend(
    device: torch.device,
    block_size: int,
    num_kv_heads: int,
    compile_decode: bool = False,
    enforce_eager: bool = False,
) -> AttentionBackend:
    """Triton on CUDA; on CPU the compiled path with `compile_decode`, else the eager backend
    with our C++ decode kernel (the plain eager reference where the kernels are not built).

    `enforce_eager` (no CUDA graphs, no torch.compile) keeps the Triton kernels, as vLLM keeps
    its attention backend: it changes how kernels are launched, not which.
    """
    if device.type == "cuda":
        if _triton_usable(block_size):
            from nanoserve.platforms.cuda.attention import TritonAttention  # imports triton

            return TritonAttention(num_kv_heads)
        logger.warning(
            "CUDA without the Triton backend (triton not installed, or block_size %d < %d): "
            "attention runs the eager torch path",
            block_size,
            TRITON_MIN_BLOCK_SIZE,
        )
    if compile_decode and device.type == "cpu" and not enforce_eager:
        return CompiledCpuAttention()
    kernels = load_cpu_kernels() if device.type == "cpu" else None
    return EagerAttention() if kernels is None else CpuKernelAttention(kernels)


def _triton_usable(block_size: int) -> bool:
    return block_size >= TRITON_MIN_BLOCK_SIZE and importlib.util.find_spec("triton") is not None
