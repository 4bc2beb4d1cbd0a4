"""RMSNorm, computed in float32 whatever the weights' dtype (as transformers does)."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D] -> [..., D]
    """x / rms(x) over the last dim, computed in float32 and rounded back to x's dtype.

    This is RMSNorm without its learned scale: transformers rounds to the input dtype *before*
    scaling, so callers multiply by the weight afterwards (and may use one weight per head).
    """
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
        return self.weight * rms_normalize(x, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
