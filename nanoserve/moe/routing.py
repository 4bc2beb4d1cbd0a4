"""The router's choice for each token, and a step's choices grouped by expert.

    route            softmax over the experts, the top k, renormalized when the model says so
    group_by_expert  the (token, expert) pairs of a step sorted by expert: every expert then
                     runs once, over all of its tokens, and an expert no token picked not at all

Routing is computed the way transformers computes it (softmax in float32 over the router's
logits in the model dtype, `torch.topk`), so ties between scores resolve as they do there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route(
    router_logits: torch.Tensor,  # [T, E] in the model dtype
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32 weights, [T, k] int64 expert ids)
    """Each token's top-k experts and the weight of each (their softmax probabilities)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


@dataclass(frozen=True)
class ExpertGroups:
    """One step's (token, expert) pairs for this rank's experts, sorted by expert.

    Pair a (of A) sends token `token_index[a]` to local expert `expert_of[a]` with weight
    `weights[a]`; the pairs of `expert_ids[u]` are rows `offsets[u]:offsets[u + 1]`. Only
    experts with at least one token appear in `expert_ids`.
    """

    token_index: torch.Tensor  # [A] int64
    weights: torch.Tensor  # [A] float32
    expert_of: torch.Tensor  # [A] int64, local expert ids, ascending
    expert_ids: torch.Tensor  # [U] int64, the local experts with tokens, ascending
    offsets: torch.Tensor  # [U + 1] int64

    def spans(self) -> list[tuple[int, int, int]]:
        """(local expert, first pair, end) of each expert with tokens, on the host."""
        ids, offsets = self.expert_ids.tolist(), self.offsets.tolist()
        return [(e, offsets[u], offsets[u + 1]) for u, e in enumerate(ids)]


def group_by_expert(
    expert_ids: torch.Tensor,  # [T, k] int64, global expert ids
    weights: torch.Tensor,  # [T, k] float32
    first_expert: int,
    num_local_experts: int,
) -> ExpertGroups:
    """The pairs whose expert is one of this rank's (`first_expert` + 0 .. num_local - 1)."""
    top_k = expert_ids.shape[1]
    local = expert_ids.flatten() - first_expert  # [T * k]
    is_local = (local >= 0) & (local < num_local_experts)
    pairs = is_local.nonzero().squeeze(1)  # [A]: positions in the flat [T * k] choices
    # A stable sort keeps each expert's tokens in token order (and ties in top-k order).
    order = torch.sort(local[pairs], stable=True).indices
    pairs = pairs[order]
    expert_of = local[pairs]  # [A], ascending
    counts = torch.bincount(expert_of, minlength=num_local_experts)  # [E_local]
    expert_ids_with_tokens = counts.nonzero().squeeze(1)  # [U]
    offsets = counts.new_zeros(len(expert_ids_with_tokens) + 1)  # [U + 1]
    torch.cumsum(counts[expert_ids_with_tokens], 0, out=offsets[1:])
    return ExpertGroups(
        token_index=pairs // top_k,
        weights=weights.flatten()[pairs],
        expert_of=expert_of,
        expert_ids=expert_ids_with_tokens,
        offsets=offsets,
    )
