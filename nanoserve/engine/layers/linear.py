"""Linear layers that fuse several checkpoint projections into one matmul."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
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
