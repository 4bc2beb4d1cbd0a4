"""The fused CPU decode step: every decoder layer of a Llama-family model in one C++ call.

A decode step of the 0.6B shape streams ~1.2 GB of weights through the GEMVs in ~50 ms; the
rest is ~15 tensor ops per layer, each a few microseconds of Python and dispatch, ~5 ms a step
for 28 layers. `FusedDecodeRunner` is a step runner that takes decode steps (of up to
`GEMV_STEP_TOKENS` tokens where a linear's decode product is a GEMV: int8, or bf16 on a CPU
whose oneDNN cannot pack it) and hands the layers to `DecodeLayers` (`csrc/decode_layers.cpp`),
which runs the reference layer's ops in the reference's order through the same kernels the
eager step calls: the embedding, the RoPE tables, the final norm and the LM head stay in
Python, and the hidden states are bit for bit the eager runner's. Drafts to verify are laid
out as decode tokens (`step_layout.py`) and come here too, and so do steps whose prompt chunks
the kernel backend attends token by token (`attends_token_by_token`: an editor's next
keystroke after one that never ran, new tokens over a cached document, up to the 128 the
kernel attends as one chunk over the paged cache; a short prompt with little cached): the last
layer then finishes only the rows that sample, as the eager model does. Other prompt chunks
(and, where a GEMV limits them, larger batches) go to the runners after it.

A step runs its layers in `LAYER_SPANS` calls and asks between them whether it was abandoned
(`StepLayout.is_abandoned`): when an editor's next keystroke aborts the completion being
decoded, the keystroke's own step need not wait for the rest of the old one.

Layers with experts in place of the MLP (Qwen3-MoE, Mixtral: `SparseMoeBlock`) run as the CPU
MoE methods run a decode step (`moe/cpu.py`, `moe/int8.py`): the router's GEMV, the top k, the
choices added to the expert-load counter, the pairs grouped, the chosen experts' grouped GEMVs,
the weighted sum; such models' fused steps take up to `GEMV_STEP_TOKENS` tokens, the most the
grouped GEMVs take.

It takes a model only where every piece of a layer is one the C++ side knows, and says in the
log why not otherwise: the Llama family's layers (an MLP, or experts run by the CPU methods
with every expert on this rank), one rank, a KV cache in the model's bf16 attended by the CPU
kernel backend, every linear packed for oneDNN (its decode products by the GEMV up to the
tuned size, as `PackedLinearMethod` does), widened with the GEMV, or int8 in row pairs, and the
fused layer ops installed.
"""

from __future__ import annotations

import logging
from itertools import pairwise
from types import ModuleType
from typing import Any, cast

import torch

from nanoserve.core.layers.linear import Linear
from nanoserve.core.layers.ops import LayerOps
from nanoserve.core.model_runner import EagerStepRunner, StepAbandoned, StepRunner
from nanoserve.core.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from nanoserve.core.step_layout import StepLayout
from nanoserve.moe.cpu import GEMV_ROWS_PER_PASS, CpuMoeMethod, PairKernels
from nanoserve.moe.int8 import GEMV_MAX_TOKENS as INT8_EXPERT_ROWS
from nanoserve.moe.int8 import Int8MoeMethod, QuantizedExperts
from nanoserve.moe.layer import ROUTER_GEMV_MAX_TOKENS, SparseMoeBlock
from nanoserve.moe.models import MoeForCausalLM
from nanoserve.platforms.cpu.attention import (
    CpuKernelAttention,
    attends_token_by_token,
    token_contexts,
)
from nanoserve.platforms.cpu.fused_ops import FusedCpuOps
from nanoserve.platforms.cpu.linear import GEMV_CALL_ROWS, PackedLinearMethod, WideningLinearMethod
from nanoserve.quantization.int8 import Int8LinearMethod

logger = logging.getLogger("nanoserve.fused_decode")

ABSENT = torch.empty(0)  # a slot the layer does not have (no bias, no q/k norm, no scales)
# The most tokens a fused step runs where a linear always streams through a GEMV (int8, or
# widened bf16): the GEMVs take up to 8 rows a call, as the eager methods call them.
GEMV_STEP_TOKENS = GEMV_CALL_ROWS
# Calls a step's layers are run in (each a few microseconds besides its layers' work); a step
# abandoned while it runs stops at the end of the span in flight.
LAYER_SPANS = 4


class NotFusable(Exception):
    """Why a model's layers cannot go through `DecodeLayers` (said in the log)."""


def linear_tensors(layer: Linear) -> list[torch.Tensor]:
    """(the GEMV's weight, int8 scales, bias, packed weight) of a linear as the C++ side reads
    them (the GEMV's weight in its layout: int8 blocks or row pairs, `bf16_gemv_weight`'s, or
    plain)."""
    bias = ABSENT if layer.bias is None else layer.bias
    method = layer.method
    if isinstance(method, Int8LinearMethod) and layer.int8_in_gemv_layout:
        weight = cast(torch.Tensor, layer.int8_weight)
        return [weight, cast(torch.Tensor, layer.int8_gemv_scales), bias, ABSENT]
    if isinstance(method, PackedLinearMethod) and layer.packed_weight is not None:
        gemv_weight = cast(torch.Tensor, layer.gemv_weight) if method.gemv is not None else ABSENT
        return [gemv_weight, ABSENT, bias, cast(torch.Tensor, layer.packed_weight)]
    if isinstance(method, WideningLinearMethod) and method.gemv and layer.weight is not None:
        return [layer.weight, ABSENT, bias, ABSENT]
    raise NotFusable(f"a linear whose decode product is not ours ({type(method).__name__})")


def most_tokens(model: torch.nn.Module) -> int | None:
    """The most tokens a fused step may run: GEMV_STEP_TOKENS where some linear is not packed
    (its product is a GEMV whatever the size) or the layers have experts (the CPU methods'
    grouped GEMVs take steps of up to that many tokens), else no limit (oneDNN takes any)."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    has_experts = any(isinstance(m, SparseMoeBlock) for m in model.modules())
    if has_experts:
        return min(GEMV_STEP_TOKENS, ROUTER_GEMV_MAX_TOKENS, GEMV_ROWS_PER_PASS, INT8_EXPERT_ROWS)
    if all(isinstance(m.method, PackedLinearMethod) for m in linears):
        return None
    return GEMV_STEP_TOKENS


def gemv_rows(model: torch.nn.Module) -> int:
    """Up to how many tokens the packed linears' decode products are GEMVs (one method: one
    number for every layer)."""
    methods = {m.method for m in model.modules() if isinstance(m, Linear)}
    rows = {m.gemv_max_rows for m in methods if isinstance(m, PackedLinearMethod)}
    if len(rows) > 1:
        raise NotFusable("packed linears with different GEMV sizes")
    return rows.pop() if rows else 0


def check_ops(*modules: Any) -> None:
    """The eager layers compute their norms, RoPE and SwiGLU through the fused kernels."""
    for module in modules:
        ops: LayerOps = module.ops
        if not isinstance(ops, FusedCpuOps):
            raise NotFusable("the fused layer ops are not installed")


def expert_tensors(block: SparseMoeBlock) -> list[torch.Tensor]:
    """(router, w13, its scales, w2, its scales, expert-load counter) of a layer's experts, as
    the C++ side reads them: bf16 experts of the CPU method, or int8 ones in row pairs."""
    method = block.method
    if block.shard.count != block.num_experts:
        raise NotFusable("experts spread over ranks (expert parallelism)")
    if method.router_gemv is None or not isinstance(method.pairs, PairKernels):
        raise NotFusable("an MoE router or pair grouping not through the kernels")
    if block.expert_load is None:  # the counter the eager steps create at their first
        block.expert_load = torch.zeros(block.num_experts, dtype=torch.int64)
    if isinstance(method, Int8MoeMethod) and method.gemv is not None:
        w13 = cast(QuantizedExperts, block.int8_w13)
        w2 = cast(QuantizedExperts, block.int8_w2)
        if not w13.paired:
            raise NotFusable("int8 experts not in row pairs")
        experts = [w13.values, w13.scales, w2.values, w2.scales]
    elif type(method) is CpuMoeMethod and block.w13.dtype == torch.bfloat16:
        experts = [block.w13, ABSENT, block.w2, ABSENT]
    else:
        raise NotFusable(f"experts run by {type(method).__name__}")
    return [block.gate, *experts, block.expert_load]


def mlp_tensors(mlp: torch.nn.Module) -> list[torch.Tensor]:
    """The MLP slots, then the experts' (`expert_tensors`): one of the two is absent."""
    check_ops(mlp)
    if isinstance(mlp, SparseMoeBlock):
        return [ABSENT] * 8 + expert_tensors(mlp)
    if type(mlp) is not LlamaMLP:
        raise NotFusable(f"a layer whose MLP is a {type(mlp).__name__}")
    dense = cast(LlamaMLP, mlp)
    return [*linear_tensors(dense.gate_up_proj), *linear_tensors(dense.down_proj), *[ABSENT] * 6]


def layer_tensors(layer: LlamaDecoderLayer, dtype: torch.dtype) -> list[torch.Tensor]:
    """One decoder layer's tensors in `decode_layers.cpp`'s `Slot` order."""
    attn = layer.self_attn
    if type(attn) is not LlamaAttention:
        raise NotFusable(f"a layer of {type(attn).__name__}")
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [attn.q_norm, attn.k_norm] if attn.qk_norm else []
    check_ops(attn, *norms)
    if any(norm.weight.dtype != dtype for norm in norms):
        raise NotFusable("norm weights in another dtype than the activations")
    cache = attn.attn
    if cache.k_cache is None or cache.k_cache.dtype != dtype:
        raise NotFusable("a KV cache in another dtype than the model's (FP8?)")
    if not isinstance(cache.backend, CpuKernelAttention):
        raise NotFusable(f"the {type(cache.backend).__name__} attention backend")
    q_norm = [attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm else [ABSENT, ABSENT]
    return [
        layer.input_layernorm.weight,
        *linear_tensors(attn.qkv_proj),
        *q_norm,
        *linear_tensors(attn.o_proj),
        layer.post_attention_layernorm.weight,
        *mlp_tensors(layer.mlp),
        cache.k_cache,
        cache.v_cache,
    ]


def fused_layers(model: torch.nn.Module, kernels: ModuleType) -> Any:
    """The model's decoder layers as one `DecodeLayers`; raises NotFusable saying why not."""
    if not isinstance(model, LlamaForCausalLM):
        raise NotFusable(f"a {type(model).__name__}")
    if model.tp.size > 1:
        raise NotFusable("tensor parallelism (each layer's products end in an all-reduce)")
    dtype = model.model.norm.weight.dtype  # the activations' (the embedding may hold none)
    if dtype != torch.bfloat16:
        raise NotFusable(f"{dtype} activations (the GEMVs take bf16)")
    layers = cast(list[LlamaDecoderLayer], list(model.model.layers))
    epsilons = {norm.eps for norm in model.modules() if hasattr(norm, "eps")}
    if len(epsilons) != 1:
        raise NotFusable("norms with different epsilons")
    tensors = [t for layer in layers for t in layer_tensors(layer, dtype)]
    attn = layers[0].self_attn
    eps, scale = epsilons.pop(), attn.attn.scale
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    routing = {(b.top_k, b.renormalize) for b in blocks} or {(0, False)}
    [(top_k, renormalize)] = routing  # one model config: the same for every sparse layer
    return kernels.DecodeLayers(
        tensors, *heads, eps, scale, gemv_rows(model), top_k=top_k, renormalize=renormalize
    )


class FusedDecodeRunner(StepRunner):
    """Decode steps (of up to `max_tokens`, or any size) through `DecodeLayers` (see above)."""

    name = "cpu-fused-decode"

    def __init__(
        self, eager: EagerStepRunner, layers: Any, max_tokens: int | None, chunk_runs: bool
    ) -> None:
        super().__init__(eager.model)
        self.eager = eager
        self.layers = layers
        self.max_tokens = max_tokens
        self.chunk_runs = chunk_runs  # whether the kernel attends tokens in a row as chunks
        self.spans = layer_spans(layers.num_layers, LAYER_SPANS)

    def can_run(self, layout: StepLayout) -> bool:
        """Decode steps, and steps of prompt chunks whose tokens attend one by one through
        the paged-decode kernel in the eager runner too (short chunks, or few keys in all),
        without prompt logprobs."""
        return (
            attends_token_by_token(layout, self.chunk_runs)
            and not layout.prompt_logprob_rows.rows
            and (self.max_tokens is None or len(layout.input_ids) <= self.max_tokens)
        )

    def run(self, layout: StepLayout) -> torch.Tensor:  # [S, hidden]: the rows that sample
        eager, model = self.eager, cast(LlamaForCausalLM, self.model).model
        meta = eager.backend.build_metadata(layout, eager.block_size, eager.device)
        contexts = token_contexts(meta)  # each token's block table [T, max_blocks], context [T]
        assert contexts is not None, "a step the kernel backend attends token by token"
        input_ids = torch.tensor(layout.input_ids, dtype=torch.int64)  # [T]
        positions = torch.tensor(layout.positions, dtype=torch.int64)  # [T]
        rows = ABSENT  # all rows sample (decode steps), or only these (a prompt's last token)
        if not layout.is_every_row_output:
            rows = torch.tensor(layout.output_rows, dtype=torch.int64)  # [S]
        x = model.embed_tokens(input_ids)  # [T, hidden]
        cos, signed_sin = model.rotary_emb(positions, x.dtype)  # [T, 1, D] each
        step = (cos, signed_sin, meta.slot_mapping, *contexts)
        for begin, end in self.spans:
            if begin > 0 and layout.is_abandoned():
                raise StepAbandoned
            x = self.layers(x, *step, begin, end, rows)
        if isinstance(self.model, MoeForCausalLM):
            self.model.load_log.maybe_log(self.model, x.device)
        return model.norm(x)


def layer_spans(num_layers: int, num_spans: int) -> list[tuple[int, int]]:
    """[begin, end) of `num_spans` runs of layers (fewer if there are fewer layers), in order,
    lengths differing by at most one."""
    num_spans = min(num_spans, num_layers)
    bounds = [num_layers * i // num_spans for i in range(num_spans + 1)]
    return list(pairwise(bounds))


def fused_decode_runner(eager: StepRunner, kernels: ModuleType) -> FusedDecodeRunner | None:
    """The fused decode runner for the eager runner's model, through `kernels` (the built C++
    kernels), or None (logged) where the model has a piece `DecodeLayers` does not know."""
    if not isinstance(eager, EagerStepRunner):
        return None
    try:
        layers = fused_layers(eager.model, kernels)
    except NotFusable as reason:
        logger.info("decode steps run layer by layer: %s", reason)
        return None
    max_tokens = most_tokens(eager.model)
    size = "any size" if max_tokens is None else f"up to {max_tokens} tokens"
    logger.info("decode steps of %s run their %d layers in one call", size, layers.num_layers)
    return FusedDecodeRunner(eager, layers, max_tokens, attends_chunk_runs(eager.model, kernels))


def attends_chunk_runs(model: torch.nn.Module, kernels: ModuleType) -> bool:
    """Whether the paged-decode kernel attends a request's tokens in a row as one chunk over
    this model's KV cache (bf16, the head and block sizes its tiles take)."""
    attn = cast(LlamaDecoderLayer, cast(LlamaForCausalLM, model).model.layers[0]).self_attn
    k_cache = attn.attn.k_cache
    assert k_cache is not None, "checked by `fused_layers`"
    query = torch.empty(0, attn.num_heads, attn.head_dim, dtype=k_cache.dtype)  # [0, H, D]
    return kernels.paged_chunk_attention_takes(query, k_cache)
