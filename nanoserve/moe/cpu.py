"""CpuMoeMethod: decode steps through the C++ grouped GEMV, reading only the chosen experts.

A decode step of a few tokens is bound by the bytes it reads. Its (token, expert) pairs,
grouped by expert, go through `moe_bf16_gemv` (`platforms/cpu/csrc/gemv.cpp`) twice — gate/up,
then down — and each chosen expert's rows stream from memory once for all of its tokens; the
experts nobody chose are not touched. The weights are the one stacked bf16 copy the model loaded
(no packed second copy: experts are most of an MoE model's memory). Longer steps (prefills,
large batches) are compute-bound and run the grouped PyTorch method over the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.moe.layer import GROUPED, MoeMethod, SparseMoeBlock, combine

# Most tokens a step may have for the GEMV: beyond this the product is compute-bound.
GEMV_MAX_TOKENS = 4

# (x [A, K], weight [E, N, K], expert_ids [U], offsets [U + 1]) -> [A, N]
GroupedGemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CpuMoeMethod(MoeMethod):
    """bf16 experts; decode steps by the grouped GEMV, longer steps by the grouped method."""

    def __init__(self, grouped_gemv: GroupedGemv) -> None:
        self.grouped_gemv = grouped_gemv

    def apply(self, layer: SparseMoeBlock, x, weights, expert_ids) -> torch.Tensor:
        is_decode = x.dtype == torch.bfloat16 and x.shape[0] <= GEMV_MAX_TOKENS
        if not is_decode or layer.w13.dtype != torch.bfloat16:
            return GROUPED.apply(layer, x, weights, expert_ids)
        groups = layer.group(weights, expert_ids)
        tokens = x[groups.token_index]  # [A, H]: each pair's token, grouped by expert
        ids, offsets = groups.expert_ids, groups.offsets
        gate_up = self.grouped_gemv(tokens, layer.w13, ids, offsets)  # [A, 2I]
        expert_out = self.grouped_gemv(layer.ops.silu_mul(gate_up), layer.w2, ids, offsets)
        return combine(x, groups, expert_out)  # [A, H] -> [T, H]
