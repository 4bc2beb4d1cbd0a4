"""The sampler's passes over whole rows on CPU, through the C++ kernels (`csrc/sampling.cpp`).

PyTorch's CPU ops take these one value at a time: `max(dim=-1)` with its indices (a greedy
step's argmax), and `exponential_` or a float64 `cumsum` over a random row (a draw). Over
the 0.6B shape's 151,936-token vocabulary at 8 requests a step, those cost milliseconds; the
kernels read each row once, in vector lanes, and answer as the portable `SamplerOps` does.
"""

from __future__ import annotations

from types import ModuleType

import torch

from nanoserve.core.sampler import SamplerOps


class CpuSamplerOps(SamplerOps):
    """`SamplerOps` whose float32 rows on the CPU go through the kernels; others through the
    portable ops."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        self.vector_argmax = kernels.sampling_is_vectorized()  # else PyTorch's is as fast

    def argmax(self, x: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        if self.vector_argmax and kernels_take(x):
            return self.kernels.row_argmax(x)
        return super().argmax(x)

    def draw(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # -> [B]
        if kernels_take(probs) and uniforms.dtype == torch.float64:
            return self.kernels.draw_rows(probs, uniforms)
        return super().draw(probs, uniforms)


def kernels_take(x: torch.Tensor) -> bool:
    """Rows the kernels read: float32 [B, V > 0] in host memory, each row contiguous."""
    is_rows = x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1
    return is_rows and x.dtype == torch.float32 and x.device.type == "cpu"
