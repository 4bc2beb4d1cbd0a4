"""Fused CPU versions of RMSNorm, the rotary embedding and SwiGLU's silu(gate) * up, used by
eager CPU steps.

A decode step's RMSNorm is 7 PyTorch ops over one row of 1024 values (cast, square, mean, add,
rsqrt, multiply, cast back, then the weight), and rotating q and k takes 5 more each: at a few
microseconds of dispatch apiece, ~200 µs per layer of a step that streams ~30 MB of weights.
`csrc/fused_ops.cpp` computes each in one pass with PyTorch's roundings (see `cpu_kernels`).

The model runner turns them on for a CPU model (`use_fused_cpu_ops`); `fused_ops_for(x)` then
hands the kernels to `norm.py`, `rotary.py` and the models' MLP for CPU tensors of bf16 or
float32 outside torch.compile (inductor fuses those ops itself). Elsewhere, or when the
kernels could not be built, the plain ops run.
"""

from __future__ import annotations

from types import ModuleType

import torch

from nanoserve.platforms.cpu.kernels import load_cpu_kernels

_fused: ModuleType | None = None
FUSED_DTYPES = (torch.bfloat16, torch.float32)


def use_fused_cpu_ops(enabled: bool = True) -> bool:
    """Turn the fused ops on (building them if needed) or off; True if they are now on."""
    global _fused
    _fused = load_cpu_kernels() if enabled else None
    return _fused is not None


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The kernels, if they are on and take `x` (CPU, bf16/float32, eager); else None."""
    if _fused is None or not x.is_cpu or x.dtype not in FUSED_DTYPES:
        return None
    return None if torch.compiler.is_compiling() else _fused
