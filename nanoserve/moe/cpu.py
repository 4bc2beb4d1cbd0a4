"""CpuMoeMethod: decode steps through the C++ grouped GEMV, reading only the chosen experts.

A decode step of a few tokens is bound by the bytes it reads. Its (token, expert) pairs,
grouped by expert, go through `moe_bf16_gemv` (`platforms/cpu/csrc/gemv.cpp`) twice — gate/up,
then down — and each chosen expert's rows stream from memory once for all of its tokens; the
experts nobody chose are not touched. The weights are the one stacked bf16 copy the model loaded
(no packed second copy: experts are most of an MoE model's memory).

The GEMV reads an expert's weights once per 8 of its rows. While a step's pairs average at most
that many per chosen expert, each expert is read about once, which is the least any method can
read: batches of decode steps (8 tokens to 128 experts, 64 of them chosen once) go here too.
Past that (prefills) the product is compute-bound and the grouped PyTorch method, oneDNN's
matrix product per expert, wins: on the Qwen3-30B-A3B layer shape (AMX CPU) the GEMV took 0.6x
its time at 8 tokens a step, 0.8x at 96, the same at 128 (8 pairs an expert) and 2.4x at 1,024.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from nanoserve.moe.layer import GROUPED, MoeMethod, PairOps, SparseMoeBlock
from nanoserve.moe.routing import ExpertGroups

# Rows one pass of the grouped GEMV over an expert's weights serves (csrc/gemv.cpp).
GEMV_ROWS_PER_PASS = 8

# (x [A, K], weight [E, N, K], expert_ids [U], offsets [U + 1]) -> [A, N]
GroupedGemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CpuMoeMethod(MoeMethod):
    """bf16 experts: steps of at most 8 pairs per chosen expert (on average) by the grouped
    GEMV, longer ones by the grouped method."""

    def __init__(self, grouped_gemv: GroupedGemv) -> None:
        self.grouped_gemv = grouped_gemv

    def apply(self, layer: SparseMoeBlock, x, weights, expert_ids) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or layer.w13.dtype != torch.bfloat16:
            return GROUPED.apply(layer, x, weights, expert_ids)
        groups = layer.group(weights, expert_ids)
        ids, offsets = groups.expert_ids, groups.offsets
        if len(groups.token_index) > GEMV_ROWS_PER_PASS * len(ids):  # several passes an expert
            return GROUPED.apply_groups(layer, x, groups)
        tokens = x[groups.token_index]  # [A, H]: each pair's token, grouped by expert
        gate_up = self.grouped_gemv(tokens, layer.w13, ids, offsets)  # [A, 2I]
        expert_out = self.grouped_gemv(layer.ops.silu_mul(gate_up), layer.w2, ids, offsets)
        return self.pairs.combine(x, groups, expert_out)  # [A, H] -> [T, H]


class PairKernels(PairOps):
    """`PairOps` through the C++ kernels (`csrc/moe_pairs.cpp`): the same bits."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def group(
        self, expert_ids: torch.Tensor, weights: torch.Tensor, first: int, count: int
    ) -> ExpertGroups:
        return ExpertGroups(*self.kernels.moe_group(expert_ids, weights, first, count))

    def combine(
        self, x: torch.Tensor, groups: ExpertGroups, expert_out: torch.Tensor
    ) -> torch.Tensor:
        return self.kernels.moe_combine(x, groups.token_index, groups.weights, expert_out)
