"""The sparse MoE block: a router, then each token through its top-k experts, summed by weight.

    x [T, H] -> router logits [T, E] -> top-k experts and weights per token (`routing.py`)
             -> each expert e: down_e(silu(gate_e(x)) * up_e(x)) over the tokens that picked it
             -> sum over a token's experts, weighted -> [T, H]

The experts' weights are stacked into one tensor per layer, `w13` [E, 2I, H] (each expert's gate
rows, then its up rows) and `w2` [E, H, I]; checkpoints store one tensor per expert and
projection, which the loader copies into place (`checkpoint_targets`). The router `gate` [E, H]
stays in the model dtype whatever the experts are quantized to.

With tensor parallelism every rank holds a slice of every expert (I / N of the intermediate
rows and columns, as vLLM does by default); with expert parallelism (`--enable-expert-parallel`)
whole experts, E / N of them. Either way each rank adds up a partial sum for every token and the
partial sums are all-reduced, as after a row-parallel linear.

How the experts are run is the block's `method` (`MoeMethod`, as a Linear's `LinearMethod`):
`GroupedMoeMethod` by default, plain PyTorch, each expert once over all of its tokens; platforms
and quantization install others (`cpu.py`, `int8.py`, `triton.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.common.config import ModelConfig, MoeConfig
from nanoserve.core.layers.linear import CheckpointSlice, CheckpointTargets
from nanoserve.core.layers.ops import PORTABLE_OPS
from nanoserve.core.parallel import TensorParallel
from nanoserve.moe.routing import ExpertGroups, group_by_expert, route

# Most tokens whose router product a method's `router_gemv` takes (one pass over the weight).
ROUTER_GEMV_MAX_TOKENS = 8


@dataclass(frozen=True)
class ExpertNames:
    """Where a checkpoint keeps a block's tensors: `<block>.gate.weight` (the router) and
    `<block>.experts.<e>.<gate|up|down>.weight`."""

    block: str  # the block's name under its decoder layer: "mlp" or "block_sparse_moe"
    gate: str  # "gate_proj" or "w1"
    up: str  # "up_proj" or "w3"
    down: str  # "down_proj" or "w2"


QWEN3_MOE_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


@dataclass(frozen=True)
class ExpertShard:
    """The part of a layer's experts one rank holds: experts `first .. first + count - 1`,
    intermediate rows `inter_start .. inter_start + inter_size - 1` of each."""

    first: int
    count: int
    inter_start: int
    inter_size: int
    is_sliced: bool  # each expert cut along its intermediate dim (tensor parallelism)

    @staticmethod
    def of(moe: MoeConfig, tp: TensorParallel, expert_parallel: bool) -> ExpertShard:
        if expert_parallel:
            count = tp.split(moe.num_experts, "num_experts (expert parallelism)")
            return ExpertShard(tp.rank * count, count, 0, moe.moe_intermediate_size, False)
        size = tp.split(moe.moe_intermediate_size, "moe_intermediate_size")
        return ExpertShard(0, moe.num_experts, tp.rank * size, size, tp.size > 1)


class PairOps:
    """A step's (token, expert) pairs grouped by expert (`group_by_expert`) and the experts'
    outputs summed back per token (`combine`): in PyTorch here, or a CPU's C++ kernels that
    compute the same bits with one call each (`cpu.PairKernels`)."""

    def group(
        self, expert_ids: torch.Tensor, weights: torch.Tensor, first: int, count: int
    ) -> ExpertGroups:
        return group_by_expert(expert_ids, weights, first, count)

    def combine(
        self, x: torch.Tensor, groups: ExpertGroups, expert_out: torch.Tensor
    ) -> torch.Tensor:
        return combine(x, groups, expert_out)


class MoeMethod:
    """How a SparseMoeBlock runs its experts over a step's grouped tokens; subclasses may store
    the weights differently (`process_weights`, called once after loading).

    `router_gemv` (a CPU's bf16 GEMV, [T, H] x [E, H] -> [T, E]) takes the router's product for
    steps of up to ROUTER_GEMV_MAX_TOKENS bf16 tokens: PyTorch's bf16 matmul spends ~0.1 ms
    re-blocking the router's weight for each one-token step, four times the GEMV's read of it.
    `pairs` groups a step's pairs and sums them back (a CPU's kernels replace PyTorch's ~15
    small ops, each costing its dispatch at a decode step's sizes, with two calls).
    """

    router_gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    pairs = PairOps()

    def process_weights(self, layer: SparseMoeBlock) -> None:
        """Reshape, pack or quantize `layer.w13` and `layer.w2` here."""

    def router_logits(self, layer: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the router's logits [T, E], in x's dtype."""
        gemv, gate = self.router_gemv, layer.gate
        is_decode = x.dtype == gate.dtype == torch.bfloat16 and x.shape[0] <= ROUTER_GEMV_MAX_TOKENS
        if gemv is not None and is_decode and x.shape[0] > 0:
            return gemv(x, gate)
        return F.linear(x, gate)

    def apply(
        self,
        layer: SparseMoeBlock,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] float32: each token's routing weights
        expert_ids: torch.Tensor,  # [T, k] int64: each token's experts (global ids)
    ) -> torch.Tensor:  # [T, H]: this rank's weighted sum of its experts' outputs
        raise NotImplementedError


class GroupedMoeMethod(MoeMethod):
    """Plain PyTorch: each expert with tokens runs once over all of them (two matmuls)."""

    def apply(self, layer: SparseMoeBlock, x, weights, expert_ids) -> torch.Tensor:
        return self.apply_groups(layer, x, layer.group(weights, expert_ids))

    def apply_groups(self, layer: SparseMoeBlock, x, groups: ExpertGroups) -> torch.Tensor:
        """`apply` for pairs already grouped by expert."""
        expert_out = x.new_empty(len(groups.token_index), x.shape[1])  # [A, H]
        tokens = x[groups.token_index]  # [A, H]: each pair's token, grouped by expert
        for expert, start, end in groups.spans():
            gate_up = F.linear(tokens[start:end], layer.w13[expert])  # [n, 2I]
            expert_out[start:end] = F.linear(layer.ops.silu_mul(gate_up), layer.w2[expert])
        return combine(x, groups, expert_out)


def combine(x: torch.Tensor, groups: ExpertGroups, expert_out: torch.Tensor) -> torch.Tensor:
    """Each token's experts' outputs [A, H] summed by their weights -> [T, H] (zeros for a
    token none of this rank's experts serve). The sum is float32 (PyTorch's bf16 index_add_
    is a slow serial loop), rounded once."""
    weighted = expert_out.float() * groups.weights[:, None]  # [A, H]
    summed = x.new_zeros(x.shape, dtype=torch.float32).index_add_(0, groups.token_index, weighted)
    return summed.to(x.dtype)


GROUPED = GroupedMoeMethod()


class SparseMoeBlock(nn.Module):
    """Router and experts of one decoder layer (this rank's experts, or its slice of each)."""

    def __init__(
        self, config: ModelConfig, tp: TensorParallel, expert_parallel: bool, names: ExpertNames
    ) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.num_experts, self.top_k = moe.num_experts, moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.shard = ExpertShard.of(moe, tp, expert_parallel)
        self.names = names
        self.tp = tp
        hidden, inter = config.hidden_size, self.shard.inter_size
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden))  # the router [E, H]
        self.w13 = nn.Parameter(torch.empty(self.shard.count, 2 * inter, hidden))  # [E', 2I', H]
        self.w2 = nn.Parameter(torch.empty(self.shard.count, hidden, inter))  # [E', H, I']
        self.method: MoeMethod = GROUPED
        self.ops = PORTABLE_OPS  # silu(gate) * up (a platform may install a kernel)
        self.expert_load: torch.Tensor | None = None  # [E] tokens routed to each, all steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = self.method.router_logits(self, x)  # [T, E]
        weights, expert_ids = route(router_logits, self.top_k, self.renormalize)  # [T, k] each
        self.count_load(expert_ids)
        return self.tp.all_reduce(self.method.apply(self, x, weights, expert_ids))

    def group(self, weights: torch.Tensor, expert_ids: torch.Tensor) -> ExpertGroups:
        """The step's (token, expert) pairs of this rank's experts, grouped by expert."""
        return self.method.pairs.group(expert_ids, weights, self.shard.first, self.shard.count)

    def count_load(self, expert_ids: torch.Tensor) -> None:
        """Add this step's choices to `expert_load` (a fixed [E] counter: bounded memory)."""
        if self.expert_load is None:
            self.expert_load = expert_ids.new_zeros(self.num_experts)
        choices = expert_ids.flatten()  # [T * k]
        self.expert_load.index_add_(0, choices, torch.ones_like(choices))

    def checkpoint_targets(
        self, module_name: str, param_name: str, param: torch.Tensor
    ) -> CheckpointTargets:
        """Each checkpoint tensor of this rank's experts -> its place in the stacked ones."""
        prefix = f"{module_name.rpartition('.')[0]}.{self.names.block}"
        if param_name == "gate":
            return {f"{prefix}.gate.weight": (param, None)}
        shard, names = self.shard, self.names
        rows = CheckpointSlice(0, shard.inter_start, shard.inter_size) if shard.is_sliced else None
        cols = CheckpointSlice(1, shard.inter_start, shard.inter_size) if shard.is_sliced else None
        targets: CheckpointTargets = {}
        for local in range(shard.count):
            expert = f"{prefix}.experts.{shard.first + local}"
            if param_name == "w13":
                gate, up = param[local].split(shard.inter_size)  # [I', H] each
                targets[f"{expert}.{names.gate}.weight"] = (gate, rows)
                targets[f"{expert}.{names.up}.weight"] = (up, rows)
            else:
                targets[f"{expert}.{names.down}.weight"] = (param[local], cols)
        # Expert parallelism: the other ranks' experts are read as zero rows (nothing).
        nothing = (param.new_empty(0, param.shape[2]), CheckpointSlice(0, 0, 0))
        others = set(range(self.num_experts)) - set(range(shard.first, shard.first + shard.count))
        for other in sorted(others):
            projections = (names.gate, names.up) if param_name == "w13" else (names.down,)
            for projection in projections:
                targets[f"{prefix}.experts.{other}.{projection}.weight"] = nothing
        return targets


def install_moe_method(model: nn.Module, method: MoeMethod) -> int:
    """Give every SparseMoeBlock of `model` still on the default method `method`; how many."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.method is GROUPED]
    for block in blocks:
        block.method = method
        method.process_weights(block)
    return len(blocks)
