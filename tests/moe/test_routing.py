"""Routing: ties between router scores resolve as in transformers, and a step's choices are
grouped by expert (a token whose experts are all on one rank, an expert nobody picked)."""

from __future__ import annotations

import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from nanoserve.moe.routing import group_by_expert, route


def test_ties_in_router_scores_choose_as_transformers_does():
    config = transformers.Qwen3MoeConfig(
        hidden_size=4, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True
    )
    router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        # Experts 1, 3 and 4 have the same row: every token scores them equally.
        router.weight.copy_(
            torch.tensor([[0.1] * 4, [1.0] * 4, [0.2] * 4, [1.0] * 4] + [[1.0] * 4, [0.0] * 4])
        )
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5], [-1.0, -1.0, -1.0, -1.0]])
    _, their_weights, their_ids = router(x)
    weights, ids = route(torch.nn.functional.linear(x, router.weight), 2, renormalize=True)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights, rtol=0, atol=0)
    # Two of the three tied experts won: equal halves of the weight.
    assert set(ids[0].tolist()) < {1, 3, 4}
    torch.testing.assert_close(weights[0], torch.tensor([0.5, 0.5]))


def test_without_renormalizing_the_weights_are_the_softmax_probabilities():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])


def test_groups_are_sorted_by_expert_and_skip_experts_nobody_picked():
    ids = torch.tensor([[3, 0], [0, 2], [3, 2]])  # 3 tokens, top 2 of 5 experts: 1, 4 idle
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    groups = group_by_expert(ids, weights, first_expert=0, num_local_experts=5)
    assert groups.expert_ids.tolist() == [0, 2, 3]
    assert groups.offsets.tolist() == [0, 2, 4, 6]
    assert groups.token_index.tolist() == [0, 1, 1, 2, 0, 2]  # token order within an expert
    assert torch.equal(groups.weights, torch.tensor([0.4, 0.7, 0.3, 0.1, 0.6, 0.9]))
    assert groups.spans() == [(0, 0, 2), (2, 2, 4), (3, 4, 6)]


def test_a_rank_gets_only_its_experts_and_a_token_may_have_none_there():
    """Experts 0-1 on rank 0, 2-3 on rank 1: token 0's both experts are on rank 1."""
    ids = torch.tensor([[2, 3], [0, 3]])
    weights = torch.tensor([[0.5, 0.5], [0.8, 0.2]])
    rank0 = group_by_expert(ids, weights, first_expert=0, num_local_experts=2)
    rank1 = group_by_expert(ids, weights, first_expert=2, num_local_experts=2)
    assert rank0.token_index.tolist() == [1] and rank0.expert_ids.tolist() == [0]
    assert rank1.token_index.tolist() == [0, 0, 1]
    assert rank1.expert_ids.tolist() == [0, 1]  # local ids: experts 2 and 3
    assert rank1.offsets.tolist() == [0, 1, 3]
    nobody = group_by_expert(torch.tensor([[0, 1]]), torch.ones(1, 2), 2, 2)
    assert nobody.token_index.numel() == 0 and nobody.spans() == []
