"""Which MoE method the sparse blocks get on this machine with these settings.

--quantization int8      Int8MoeMethod (decode steps by the C++ grouped int8 GEMV on CPU)
CPU, bf16, kernels built CpuMoeMethod (decode steps by the C++ grouped bf16 GEMV)
On CPU both take the router's product of decode steps through the bf16 GEMV, and group a
step's pairs and sum them back through the C++ kernels.
otherwise                the portable grouped method (`layer.py`)
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nanoserve.common.config import EngineConfig
from nanoserve.moe.cpu import CpuMoeMethod, PairKernels
from nanoserve.moe.int8 import Int8MoeMethod
from nanoserve.moe.layer import MoeMethod, SparseMoeBlock, install_moe_method

logger = logging.getLogger("nanoserve.moe")


def install_moe_methods(model: nn.Module, config: EngineConfig, device: torch.device) -> int:
    """Install the method for this machine on every sparse block; returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return 0
    method = moe_method_for(config, device, blocks[0].w13.dtype)
    if method is None:
        return 0
    count = install_moe_method(model, method)
    logger.info("experts of %d sparse layers run by %s", count, type(method).__name__)
    return count


def moe_method_for(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> MoeMethod | None:
    kernels = None
    if device.type == "cpu":
        from nanoserve.platforms.cpu.kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
    method: MoeMethod
    if config.quantization == "int8":
        if device.type == "cuda" and not config.enforce_eager:
            raise ValueError(
                "int8 experts run by the grouped method, which CUDA graphs cannot hold: "
                "use --enforce-eager with --quantization int8 on MoE models on CUDA"
            )
        method = Int8MoeMethod(kernels.moe_int8_gemv if kernels is not None else None)
    elif device.type == "cuda":
        try:
            from nanoserve.moe.triton_moe import TritonMoeMethod
        except ImportError as error:  # no Triton: the grouped method, and no CUDA graphs
            logger.warning("the fused-MoE Triton kernels are off: %s", error)
            return None
        return TritonMoeMethod()
    elif kernels is not None and dtype == torch.bfloat16 and kernels.bf16_gemv_is_vectorized():
        method = CpuMoeMethod(kernels.moe_bf16_gemv)
    else:
        return None
    if kernels is not None and kernels.bf16_gemv_is_vectorized():
        method.router_gemv = kernels.bf16_gemv  # the router's product of decode steps
    if kernels is not None:
        method.pairs = PairKernels(kernels)  # a step's pairs grouped and summed back in C++
    return method
