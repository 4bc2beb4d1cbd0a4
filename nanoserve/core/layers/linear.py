"""Linear layers, each holding its rank's shard of the weight when the model is tensor-parallel.

    Linear               a plain projection (every rank holds all of it)
    MergedColumnLinear   projections of one input fused along the output dim (q/k/v, gate/up);
                         tensor-parallel, each rank holds its rows of every part
    RowParallelLinear    each rank holds a slice of the input columns; partial sums all-reduced
    ParallelLMHead       the vocabulary split by rows; rank 0 gathers the logits

How a layer stores its weight and multiplies by it is its `method` (vLLM's "linear method"):
`DENSE`, plain `F.linear`, unless a platform or plug-in installs another (CPU packing,
int8, FP8). Each layer tells the loader which part of which checkpoint tensor fills each of its
parameters (`checkpoint_targets`), so a rank reads only its shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.core.parallel import TensorParallel


@dataclass(frozen=True)
class CheckpointSlice:
    """The part of a checkpoint tensor a parameter holds: `length` rows (dim 0) or columns
    (dim 1) from `start`."""

    dim: int
    start: int
    length: int


# checkpoint tensor name -> (the parameter, or the part of it, it fills; the part of the
# checkpoint tensor to read, None for all of it)
CheckpointTargets = dict[str, tuple[torch.Tensor, CheckpointSlice | None]]


class LinearMethod:
    """How a `Linear` multiplies by its weight; subclasses may store the weight differently."""

    def process_weights(self, layer: Linear) -> None:
        """Called once after the weights are loaded: reshape, pack or quantize them here."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return F.linear(x, layer.weight, layer.bias)


DENSE = LinearMethod()  # the plain weight and `F.linear`: every Linear's method until replaced


class Linear(nn.Linear):
    """nn.Linear whose product is computed by its `method` (plain `F.linear` by default)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.method: LinearMethod = DENSE

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.method.apply(self, x)

    def checkpoint_targets(
        self, module_name: str, param_name: str, param: torch.Tensor
    ) -> CheckpointTargets:
        return {f"{module_name}.{param_name}": (param, None)}


@dataclass(frozen=True)
class OutputPart:
    """One projection of a `MergedColumnLinear`: its checkpoint name, the rows this rank holds
    and where those rows start in the checkpoint tensor."""

    name: str  # e.g. "q_proj"
    size: int  # rows on this rank
    checkpoint_start: int  # first of them in the checkpoint's tensor


class MergedColumnLinear(Linear):
    """Projections of the same input stacked along the output dim (q/k/v, or gate/up).

    Checkpoints store each part under its own name; the loader copies each part's rows (this
    rank's share of them) into its place. One matmul then computes every part.
    """

    def __init__(self, in_features: int, parts: list[OutputPart], bias: bool) -> None:
        super().__init__(in_features, sum(part.size for part in parts), bias=bias)
        self.parts = list(parts)

    def checkpoint_targets(
        self, module_name: str, param_name: str, param: torch.Tensor
    ) -> CheckpointTargets:
        parent = module_name.rpartition(".")[0]
        targets: CheckpointTargets = {}
        offset = 0
        for part in self.parts:
            view = param.narrow(0, offset, part.size)
            source = CheckpointSlice(0, part.checkpoint_start, part.size)
            targets[f"{parent}.{part.name}.{param_name}"] = (view, source)
            offset += part.size
        return targets


class RowParallelLinear(Linear):
    """Each rank multiplies its slice of the input features; the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        local = tp.split(in_features, "the input features of a row-parallel linear")
        super().__init__(local, out_features, bias=False)  # a bias would be summed N times
        self.tp = tp
        self.input_start = tp.rank * local

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out]
        return self.tp.all_reduce(self.method.apply(self, x))

    def checkpoint_targets(
        self, module_name: str, param_name: str, param: torch.Tensor
    ) -> CheckpointTargets:
        source = (
            CheckpointSlice(1, self.input_start, self.in_features) if self.tp.size > 1 else None
        )
        return {f"{module_name}.{param_name}": (param, source)}


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(rows per rank, this rank's first token id, its real rows): the last shard may be short."""
    rows = -(-vocab_size // tp.size)
    start = tp.rank * rows
    return rows, start, max(0, min(rows, vocab_size - start))


class ParallelLMHead(Linear):
    """The output projection split by vocabulary rows; `logits` gathers them on rank 0."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        rows, self.vocab_start, self.num_real_rows = vocab_shard(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size = vocab_size
        self.tp = tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, hidden] -> [S, vocab]
        """float32 logits on rank 0 (None on the others)."""
        local = self.method.apply(self, hidden).float()  # [S, vocab / N]
        full = self.tp.gather_to_first(local)
        return None if full is None else full[:, : self.vocab_size]

    def checkpoint_targets(
        self, module_name: str, param_name: str, param: torch.Tensor
    ) -> CheckpointTargets:
        view = param.narrow(0, 0, self.num_real_rows)
        source = CheckpointSlice(0, self.vocab_start, self.num_real_rows)
        return {f"{module_name}.{param_name}": (view, source if self.tp.size > 1 else None)}


class VocabParallelEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows; each rank looks up its ids, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        rows, self.vocab_start, self.num_real_rows = vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        is_local = (local_ids >= 0) & (local_ids < self.num_real_rows)  # [T]
        rows = F.embedding(local_ids.masked_fill(~is_local, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(rows * is_local[:, None].to(rows.dtype))

    def checkpoint_targets(
        self, module_name: str, param_name: str, param: torch.Tensor
    ) -> CheckpointTargets:
        view = param.narrow(0, 0, self.num_real_rows)
        source = CheckpointSlice(0, self.vocab_start, self.num_real_rows)
        return {f"{module_name}.{param_name}": (view, source if self.tp.size > 1 else None)}
