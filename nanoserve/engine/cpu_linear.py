"""The CPU linear method: weights packed once into oneDNN's blocked layout for bf16 matmuls.

`F.linear` on a plain bf16 weight makes oneDNN re-block the weight on every call. Packing it
once at start-up (what inductor's freezing pass does, and vLLM's CPU backend) makes every product
cheaper at every batch size, with bit-identical results (benchmarks/RESULTS.md, "Packed weights").

The packed weight is an opaque MKLDNN tensor; `torch.ops.mkldnn._linear_pointwise` multiplies
by it. Under torch.compile it is called through the `nanoserve::packed_linear` custom op, so that
inductor treats it as one extern kernel. With `--compile`, one-token products instead stream the
plain weight as a float32 reduction (`one_token_linear`), which inductor fuses with its
neighbours; the plain weight is then kept beside the packed one.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from nanoserve.engine.layers.linear import DENSE, Linear, LinearMethod

logger = logging.getLogger("nanoserve.cpu_linear")

# The batch size oneDNN tunes the blocked layout for; any number of rows works with it.
PACKING_BATCH_HINT = 8


def can_pack(weight: torch.Tensor) -> bool:
    """True for a bf16 weight on CPU when this torch build has oneDNN's packed linear."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> opaque MKLDNN [out, in]
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT)


def packed_linear(
    x: torch.Tensor,  # [T, in]
    packed_weight: torch.Tensor,  # opaque MKLDNN [out, in]
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [T, out]
    """x @ weight.T + bias with a packed weight, eager or compiled."""
    if torch.compiler.is_compiling():
        return torch.ops.nanoserve.packed_linear(x, packed_weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def one_token_linear(
    x: torch.Tensor,  # [1, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [1, out]
    """x @ weight.T for a single token, written as a reduction for torch.compile.

    Inductor turns this into one pass over the weights with float32 accumulation, fused with
    the ops around it. Run eagerly it would materialise [out, in] floats: only use it compiled.
    With more than one token inductor re-reads the weights per token, so batches take the packed
    product.
    """
    out = (weight.float() * x.float()).sum(-1, keepdim=True).t().to(x.dtype)  # [1, out]
    return out if bias is None else out + bias


class PackedLinearMethod(LinearMethod):
    """oneDNN-packed bf16 weights (`layer.packed_weight`); the plain one only if kept."""

    def __init__(self, keep_plain_weight: bool) -> None:
        self.keep_plain_weight = keep_plain_weight

    def process_weights(self, layer: Linear) -> None:
        """Pack the weight; drop the plain one unless kept (a tied weight lives on elsewhere)."""
        layer.packed_weight = pack(layer.weight)
        if not self.keep_plain_weight:
            layer.weight = None  # type: ignore[assignment]  # the packed copy replaces it

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if torch.compiler.is_compiling() and x.shape[0] == 1 and layer.weight is not None:
            return one_token_linear(x, layer.weight, layer.bias)
        return packed_linear(x, cast(torch.Tensor, layer.packed_weight), layer.bias)


def install_packed_linears(model: nn.Module, keep_plain_weights: bool) -> int:
    """Switch every packable Linear of `model` to packed weights; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    method = PackedLinearMethod(keep_plain_weights)
    packable = [m for m in layers if m.method is DENSE and can_pack(m.weight)]
    for layer in packable:
        layer.method = method
        method.process_weights(layer)
    if packable:
        logger.info("packed %d of %d linear weights for oneDNN", len(packable), len(layers))
    return len(packable)


@torch.library.custom_op("nanoserve::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x, packed_weight, bias) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed_weight.shape[0])
