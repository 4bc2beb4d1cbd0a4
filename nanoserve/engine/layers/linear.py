"""Linear layers: `Linear`, and `MergedLinear` for projections fused at load (q/k/v, gate/up).

How a layer stores its weight and multiplies by it is its `method` (vLLM's "linear method"):
`DenseLinearMethod`, plain `F.linear`, unless the model runner installs a faster one for the
device (`engine/cpu_linear.py`: oneDNN-packed weights on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """How a `Linear` multiplies by its weight; subclasses may store the weight differently."""

    def process_weights(self, layer: Linear) -> None:
        """Called once after the weights are loaded: reshape, pack or quantize them here."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return F.linear(x, layer.weight, layer.bias)


class DenseLinearMethod(LinearMethod):
    """The plain weight and `F.linear`."""


DENSE = DenseLinearMethod()


class Linear(nn.Linear):
    """nn.Linear whose product is computed by its `method` (plain `F.linear` by default)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.method: LinearMethod = DENSE

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.method.apply(self, x)


class MergedLinear(Linear):
    """Projections of the same input stacked along the output dim (q/k/v, or gate/up).

    Checkpoints store each part under its own name (`shard_names`, e.g. "q_proj"); the loader
    copies each part into its rows through `shard()`.
    """

    def __init__(
        self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        assert len(output_sizes) == len(shard_names)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names)

    def shard(self, param: torch.Tensor, shard_name: str) -> torch.Tensor:
        """The rows of `param` (this layer's weight or bias) that hold `shard_name`."""
        index = self.shard_names.index(shard_name)
        offset = sum(self.output_sizes[:index])
        return param.narrow(0, offset, self.output_sizes[index])
