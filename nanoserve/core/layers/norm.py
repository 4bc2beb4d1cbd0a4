"""RMSNorm, computed in float32 whatever the weights' dtype (as transformers does).

On CPU, eager steps take the fused kernel when it is on (`cpu_fused`): the same roundings in
one pass instead of 7 ops.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.platforms.cpu.fused_ops import fused_ops_for


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D] -> [..., D]
    """x / rms(x) over the last dim, computed in float32 and rounded back to x's dtype.

    This is RMSNorm without its learned scale: transformers rounds to the input dtype *before*
    scaling, so callers multiply by the weight afterwards (and may use one weight per head).
    """
    fused = fused_ops_for(x)
    if fused is not None and x.dim() in (2, 3):  # [T, D] or [T, heads, D]
        return fused.rms_norm(x, None, eps)
    input_dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(-1, keepdim=True)  # [..., 1]
    return (x * torch.rsqrt(variance + eps)).to(input_dtype)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned scale."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        fused = fused_ops_for(x)
        if fused is not None and x.dim() in (2, 3) and x.dtype == self.weight.dtype:
            return fused.rms_norm(x, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
