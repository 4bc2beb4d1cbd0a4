"""Qwen3-MoE and Mixtral: the Llama family's layers with experts in place of the MLP.

    embed_tokens -> N x [RMSNorm -> attention -> add -> RMSNorm -> MoE block (or SwiGLU) -> add]
                 -> RMSNorm -> lm_head

Attention, norms, RoPE, the embedding and the LM head are `core/models/llama.py`'s, with its
switches (Qwen3-MoE: q/k norms; Mixtral: neither). Qwen3-MoE layer i routes to experts when
`(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers` (a dense SwiGLU of
`intermediate_size` otherwise); every Mixtral layer does, top-2 with renormalized weights. The
Llama model is built first (on the meta device, where a module costs nothing) and each sparse
layer's MLP is then replaced by its `SparseMoeBlock`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial

import torch

from nanoserve.common.config import ModelConfig
from nanoserve.core.attention.metadata import AttentionMetadata
from nanoserve.core.models.base import CausalLM
from nanoserve.core.models.llama import LlamaForCausalLM
from nanoserve.core.parallel import TensorParallel
from nanoserve.moe.layer import MIXTRAL_NAMES, QWEN3_MOE_NAMES, ExpertNames, SparseMoeBlock

logger = logging.getLogger("nanoserve.moe")


LOG_INTERVAL_VARIABLE = "NANOSERVE_EXPERT_LOAD_LOG_S"  # seconds between lines; 0: none


class ExpertLoadLog:
    """Logs the expert load (`expert_load_summary`) at most once per `interval_s`, from eager
    steps (a replayed CUDA graph still counts, but logs at the next eager step)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last_s = time.monotonic()

    def maybe_log(self, model: MoeForCausalLM, device: torch.device) -> None:
        now = time.monotonic()
        if self.interval_s <= 0 or now - self.last_s < self.interval_s:
            return
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # reading the counts would wait on the device, which a capture forbids
        self.last_s = now
        logger.info("expert load (tokens per expert): %s", expert_load_summary(model.expert_load()))


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family causal LM whose sparse layers route each token to experts."""

    expert_names: ExpertNames = QWEN3_MOE_NAMES

    def __init__(
        self, config: ModelConfig, tp: TensorParallel | None = None, expert_parallel: bool = False
    ) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture} needs the experts' settings (config.moe)")
        super().__init__(config, tp)
        self.load_log = ExpertLoadLog(float(os.environ.get(LOG_INTERVAL_VARIABLE, "60")))
        for index, layer in enumerate(self.model.layers):
            if config.moe.is_sparse(index):
                layer.mlp = SparseMoeBlock(config, self.tp, expert_parallel, self.expert_names)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn_meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [S]
    ) -> torch.Tensor:  # [T or S, hidden]
        hidden = super().forward(input_ids, positions, attn_meta, output_rows)
        self.load_log.maybe_log(self, hidden.device)
        return hidden

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def expert_load(self) -> torch.Tensor:
        """[sparse layers, E] int64: tokens routed to each expert of each sparse layer since
        the model was loaded (warm-up included). Fixed size whatever the traffic."""
        blocks = self.moe_blocks()
        return torch.stack(
            [
                b.expert_load.cpu()
                if b.expert_load is not None
                else torch.zeros(b.num_experts, dtype=torch.int64)
                for b in blocks
            ]
        )


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): `mlp.gate`, `mlp.experts.<e>.*_proj`."""

    expert_names = QWEN3_MOE_NAMES


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral (8x7B, 8x22B): `block_sparse_moe.gate`, `block_sparse_moe.experts.<e>.w1/w2/w3`."""

    expert_names = MIXTRAL_NAMES


def moe_model_classes(expert_parallel: bool = False) -> dict[str, Callable[..., CausalLM]]:
    """The classes to register (`FastPaths.model_classes`), sharding experts as asked."""
    return {
        "Qwen3MoeForCausalLM": partial(Qwen3MoeForCausalLM, expert_parallel=expert_parallel),
        "MixtralForCausalLM": partial(MixtralForCausalLM, expert_parallel=expert_parallel),
    }


def expert_load_summary(load: torch.Tensor, top: int = 4) -> str:
    """One line for people watching routing: per sparse layer, the busiest experts and the
    share of the top-k choices they took, and how many experts got no token."""
    parts = []
    for layer, counts in enumerate(load):
        total = int(counts.sum())
        if total == 0:
            continue
        busiest = counts.topk(min(top, len(counts)))
        shares = ", ".join(
            f"{e}:{100 * c / total:.0f}%"
            for c, e in zip(busiest.values.tolist(), busiest.indices.tolist(), strict=True)
        )
        idle = int((counts == 0).sum())
        parts.append(f"layer {layer}: {shares} ({idle} idle)")
    return "; ".join(parts) or "no tokens routed yet"
