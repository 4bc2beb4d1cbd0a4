"""int8 weight-only linears: each output channel's weights scaled into [-127, 127].

Decoding one token streams every weight once, so a quarter of bf16's bytes is up to ~2× the
speed where memory bandwidth bounds the step. Activations stay in the model's dtype: the CPU
multiplies with PyTorch's int8 weight-only kernel (`aten._weight_int8pack_mm`); elsewhere the
weight is widened to the activations' dtype inside the product.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.engine.layers.linear import DENSE, Linear, LinearMethod

logger = logging.getLogger("nanoserve.quantization")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> ([out, in] int8, [out] float32 scales): weight ≈ int8 * scale."""
    absmax = weight.float().abs().amax(dim=1)  # [out]
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    quantized = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized, scales


class Int8LinearMethod(LinearMethod):
    """`layer.int8_weight` [out, in] int8 and `layer.int8_scales` [out]; no float weight."""

    def process_weights(self, layer: Linear) -> None:
        quantized, scales = quantize_int8(layer.weight.detach())
        layer.int8_weight = quantized
        layer.int8_scales = scales.to(layer.weight.dtype)
        layer.weight = None  # type: ignore[assignment]  # the int8 copy replaces it

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        weight = cast(torch.Tensor, layer.int8_weight)
        scales = cast(torch.Tensor, layer.int8_scales)
        if x.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight, scales)
        else:
            out = F.linear(x, weight.to(x.dtype)) * scales
        return out if layer.bias is None else out + layer.bias


def install_int8_linears(model: nn.Module, include_lm_head: bool = True) -> int:
    """Quantize every plain Linear of `model` (the LM head unless excluded); returns how many."""
    method = Int8LinearMethod()
    lm_head = getattr(model, "lm_head", None)
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.method is DENSE and (include_lm_head or m is not lm_head)
    ]
    for layer in layers:
        layer.method = method
        method.process_weights(layer)
    logger.info("int8 weights for %d linear layers (LM head %s)", len(layers),
                "included" if include_lm_head else "kept in the model dtype")  # fmt: skip
    return len(layers)
