"""Linear layers: packed bf16 weights on CPU, and fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.engine.layers import packed_weights


class Linear(nn.Linear):
    """nn.Linear that can run on a oneDNN-packed weight (bf16 on CPU, see `pack_weight`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed_weight: torch.Tensor | None = None  # opaque MKLDNN [out, in]

    def pack_weight(self) -> bool:
        """Swap the plain weight for a oneDNN-packed copy if it can be; returns whether it did.

        A tied weight (the LM head's) stays alive with its other owner, the embedding.
        """
        if self.weight is None or not packed_weights.can_pack(self.weight):
            return False
        self.packed_weight = packed_weights.pack(self.weight)
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed_weight is not None:
            return packed_weights.packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


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
