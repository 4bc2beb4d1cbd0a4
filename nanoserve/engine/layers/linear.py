"""Linear layers: packed bf16 weights on CPU, one-token products for the compiled decode path,
and fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.engine.layers import packed_weights


def one_token_linear(
    x: torch.Tensor,  # [1, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [1, out]
    """x @ weight.T for a single token, written as a reduction for torch.compile.

    Inductor turns this into one pass over the weights with float32 accumulation, fused with
    the ops around it, which streams bf16 weights at ~85-90% of memory bandwidth on CPU. Run
    eagerly it would materialise [out, in] floats: only use it compiled. With more than one
    token inductor re-reads the weights per token, so batches take the packed product.
    """
    out = (weight.float() * x.float()).sum(-1, keepdim=True).t().to(x.dtype)  # [1, out]
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """nn.Linear that can run on a oneDNN-packed weight (bf16 on CPU, see `pack_weight`).

    Under torch.compile a one-token input takes `one_token_linear` when the plain weight is kept.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed_weight: torch.Tensor | None = None  # opaque MKLDNN [out, in]

    def pack_weight(self, keep_plain_weight: bool = False) -> bool:
        """Add a oneDNN-packed copy of the weight if it can be made; returns whether it did.

        The plain weight is dropped unless `keep_plain_weight` (the compiled one-token path
        streams it). A tied weight (the LM head's) stays alive with its other owner.
        """
        if self.weight is None or not packed_weights.can_pack(self.weight):
            return False
        self.packed_weight = packed_weights.pack(self.weight)
        if not keep_plain_weight:
            self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if torch.compiler.is_compiling() and x.shape[0] == 1 and self.weight is not None:
            return one_token_linear(x, self.weight, self.bias)
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
