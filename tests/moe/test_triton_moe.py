"""The Triton fused-MoE kernels (on CPU under TRITON_INTERPRET=1, on a GPU where present)
against the grouped PyTorch method: decode steps pair by pair, longer ones grouped by expert."""

from __future__ import annotations

import pytest
import torch
from test_moe_layer import make_block

from nanoserve.core.parallel import TensorParallel
from nanoserve.moe.layer import GROUPED
from nanoserve.moe.routing import route
from nanoserve.moe.triton_moe import PAIRWISE_MAX_TOKENS, TritonMoeMethod


def outputs(block, x):
    weights, expert_ids = route(x @ block.gate.T, block.top_k, block.renormalize)
    with torch.no_grad():
        ours = TritonMoeMethod().apply(block, x, weights, expert_ids)
        reference = GROUPED.apply(block, x, weights, expert_ids)
    return ours, reference


# 1 and 5 tokens: the pairwise GEMV; 40: the grouped GEMM (an expert with more than BLOCK_M).
@pytest.mark.parametrize("num_tokens", [1, 5, PAIRWISE_MAX_TOKENS + 24])
def test_triton_moe_equals_the_grouped_method(num_tokens):
    block = make_block(seed=6)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens))
    ours, reference = outputs(block, x)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [3, PAIRWISE_MAX_TOKENS + 8])
def test_triton_moe_adds_only_this_ranks_experts(num_tokens):
    """Expert parallelism, rank 1 of 2: the pairs of other ranks' experts add nothing."""
    block = make_block(seed=7, expert_parallel=True, tp=TensorParallel(rank=1, size=2))
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(1))
    ours, reference = outputs(block, x)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
