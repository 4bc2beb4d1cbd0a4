"""Fused CPU versions of RMSNorm, the rotary embedding and SwiGLU's silu(gate) * up: the CPU's
layer ops (`core/layers/ops.py`).

A decode step's RMSNorm is 7 PyTorch ops over one row of 1024 values (cast, square, mean, add,
rsqrt, multiply, cast back, then the weight), and rotating q and k takes 5 more each: at a few
microseconds of dispatch apiece, ~200 µs per layer of a step that streams ~30 MB of weights.
`csrc/fused_ops.cpp` computes each in one pass with PyTorch's roundings (see `kernels.py`).

The CPU platform installs `FusedCpuOps` on every layer of a CPU model; it takes bf16 and float32
CPU tensors through the kernels outside torch.compile (inductor fuses those ops itself) and
anything else through the portable ops.
"""

from __future__ import annotations

from types import ModuleType

import torch

from nanoserve.core.layers.norm import RMSNorm
from nanoserve.core.layers.ops import LayerOps

FUSED_DTYPES = (torch.bfloat16, torch.float32)
MAX_NORMED_HEAD_DIM = 512  # the kernel's per-head buffer (csrc/fused_ops.cpp)


class FusedCpuOps(LayerOps):
    """The layer ops, through our C++ kernels (`load_cpu_kernels()`) where they apply."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernels take `x`: a bf16 or float32 CPU tensor, outside torch.compile."""
        return x.is_cpu and x.dtype in FUSED_DTYPES and not torch.compiler.is_compiling()

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:  # [T, D] or [T, heads, D]
        same_dtype = weight is None or weight.dtype == x.dtype
        if self.takes(x) and x.dim() in (2, 3) and same_dtype:
            return self.kernels.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def rotary(
        self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:  # [T, H, D]
        if self.takes(x) and cos.dtype == x.dtype and cos.is_contiguous():
            return self.kernels.rotary(x, cos, signed_sin)
        return super().rotary(x, cos, signed_sin)

    def qk_norm_rotary(
        self,
        qk: torch.Tensor,  # [T, H + Hkv, D]
        num_heads: int,
        norms: tuple[RMSNorm, RMSNorm] | None,  # the q and k norms, or None
        cos: torch.Tensor,  # [T, 1, D]
        signed_sin: torch.Tensor,  # [T, 1, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H, D], k [T, Hkv, D]
        weights = (None, None) if norms is None else (norms[0].weight, norms[1].weight)
        eps = 0.0 if norms is None else norms[0].eps
        head_dim = qk.shape[2]
        if (
            self.takes(qk)
            and qk.stride(2) == 1
            and qk.stride(1) == head_dim
            and (norms is None or head_dim <= MAX_NORMED_HEAD_DIM)
            and all(t.dtype == qk.dtype for t in (cos, signed_sin, *weights) if t is not None)
            and cos.is_contiguous()
            and signed_sin.is_contiguous()
        ):
            return self.kernels.qk_norm_rotary(qk, num_heads, *weights, cos, signed_sin, eps)
        return super().qk_norm_rotary(qk, num_heads, norms, cos, signed_sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        if self.takes(gate_up) and gate_up.dim() == 2:
            return self.kernels.silu_mul(gate_up)
        return super().silu_mul(gate_up)
