"""The sparse MoE block alone: the grouped method equals a dense loop over every expert, an
expert no token picks is never run, and a rank whose experts no token picked adds zeros."""

from __future__ import annotations

import torch

from nanoserve.common.config import ModelConfig, MoeConfig
from nanoserve.core.parallel import TensorParallel
from nanoserve.moe.layer import GROUPED, QWEN3_MOE_NAMES, MoeMethod, SparseMoeBlock
from nanoserve.moe.routing import route


def tiny_config(num_experts: int = 6, top_k: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        moe=MoeConfig(num_experts, top_k, moe_intermediate_size=32, norm_topk_prob=False),
    )


def make_block(seed: int = 0, expert_parallel: bool = False, tp=None) -> SparseMoeBlock:
    block = SparseMoeBlock(tiny_config(), tp or TensorParallel(), expert_parallel, QWEN3_MOE_NAMES)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block


def dense_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every token through every expert, weighted by its routing weight (0 if not chosen)."""
    probs = torch.softmax(x @ block.gate.T, -1)  # [T, E]
    top = probs.topk(block.top_k, -1)
    mask = torch.zeros_like(probs).scatter(1, top.indices, top.values)  # [T, E]
    out = torch.zeros_like(x)
    for e in range(block.num_experts):
        gate, up = (x @ block.w13[e].T).chunk(2, -1)
        out += mask[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ block.w2[e].T)
    return out


class CountingMethod(MoeMethod):
    """The grouped method, recording which experts it ran."""

    def __init__(self) -> None:
        self.ran: list[int] = []

    def apply(self, layer, x, weights, expert_ids) -> torch.Tensor:
        self.ran += [expert for expert, _, _ in layer.group(weights, expert_ids).spans()]
        return GROUPED.apply(layer, x, weights, expert_ids)


def test_grouped_method_equals_every_expert_densely():
    block = make_block()
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(block(x), dense_reference(block, x), rtol=1e-5, atol=1e-5)


def test_an_expert_no_token_picks_is_never_run():
    block = make_block()
    with torch.no_grad():
        block.gate[4] = -100.0  # positive rows score expert 4 far below the others
    method = CountingMethod()
    block.method = method
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2)).abs()  # positive rows
    with torch.no_grad():
        out = block(x)
    assert 4 not in method.ran and method.ran == sorted(set(method.ran))
    torch.testing.assert_close(out, dense_reference(block, x), rtol=1e-5, atol=1e-5)
    assert block.expert_load is not None and block.expert_load[4] == 0
    assert block.expert_load.sum() == 9 * 2


def test_a_rank_whose_experts_no_token_picked_adds_nothing():
    """Expert parallelism, rank 1 of 2 (experts 3-5): every token routed to experts 0-2."""
    block = make_block(expert_parallel=True, tp=TensorParallel(rank=1, size=2))
    assert block.w13.shape[0] == 3
    with torch.no_grad():
        block.gate[3:] = -100.0
        x = torch.randn(5, 32).abs()  # positive rows: experts 3-5 score lowest
        weights, expert_ids = route(x @ block.gate.T, block.top_k, block.renormalize)
        groups = block.group(weights, expert_ids)
        out = block.method.apply(block, x, weights, expert_ids)  # before the all-reduce
    assert groups.spans() == []
    assert torch.equal(out, torch.zeros(5, 32))
