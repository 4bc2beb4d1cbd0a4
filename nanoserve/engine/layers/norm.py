"""RMSNorm, computed in float32 whatever the weights' dtype (as transformers does)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned scale."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        input_dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)  # [..., 1]
        x = x * torch.rsqrt(variance + self.eps)
        # Round to the input dtype *before* scaling, the order transformers uses.
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
