"""RMSNorm, computed in float32 whatever the weights' dtype (as transformers does)."""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.core.layers.ops import PORTABLE_OPS


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned scale.

    It computes through `ops` (`layers/ops.py`), which a platform may replace with a kernel."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = PORTABLE_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        return self.ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
