"""int8 weight-only linears: each output channel's weights scaled into [-127, 127].

Decoding one token streams every weight once, so half of bf16's bytes is up to ~2× the speed
where memory bandwidth bounds the step. Activations stay in the model's dtype (but for the
rounding below). On CPU, decode steps (up to `MAX_ROWS` tokens of bf16) take our compiled
weight-streaming GEMV (`csrc/gemv.cpp`, see `cpu_kernels`), which rounds each token's
activations to int16 times a power of two (exact for every value within 2^7 of the row's
largest) and sums int8 * int16 products exactly in int32: one instruction per 32 weights,
where widening each weight to float32 cost three per 16 and made the product slower than
memory. It reads the weight in the layout the kernels take fastest on this CPU: blocks of 64
rows with AVX512-BW (`int8_gemv_blocks`, csrc/block_gemv.cpp: one instruction adds a token's
pair of k to 16 rows' sums, no horizontal sums), else row pairs (`pair_rows`: one stream feeds
two rows). PyTorch's
`aten._weight_int8pack_mm` converts more slowly still (it stays the fallback where our
kernels could not be built). Everything else (prefills, which are compute-bound, other dtypes,
GPUs) multiplies by the weight widened to the activations' dtype, which int8 values survive
exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.core.layers.linear import DENSE, Linear, LinearMethod

logger = logging.getLogger("nanoserve.quantization")

# Most tokens one GEMV call multiplies: each weight row is read once for all of them, and their
# float32 activations stay in L1/L2. Longer inputs (prefills) are compute-bound.
MAX_ROWS = 8
# The GEMV's weights come in row pairs, interleaved this many weights at a time (one 64-byte
# line holds 32 of each row): one stream feeds two rows, which memory delivered 10-30% faster.
PAIR_CHUNK = 32
# Rows quantized at a time: their float32 copy (64 x 2,048 floats: 512 KiB) stays in L2.
QUANTIZE_CHUNK_ROWS = 64

Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# [N, K] int8 -> the GEMV's blocks of 64 rows, or None where it does not take them here.
BlockLayout = Callable[[torch.Tensor], torch.Tensor | None]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> ([out, in] int8, [out] float32 scales): weight ≈ int8 * scale.

    Rows are quantized QUANTIZE_CHUNK_ROWS at a time, so the float32 temporaries stay in the
    cache (5x faster than whole-weight passes for an MoE expert; the same values).
    """
    absmax = weight.abs().amax(dim=1).float()  # [out]; exact in the weight's dtype
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    for start in range(0, weight.shape[0], QUANTIZE_CHUNK_ROWS):
        rows = slice(start, start + QUANTIZE_CHUNK_ROWS)
        values = torch.round(weight[rows].float() / scales[rows, None]).clamp(-127, 127)
        quantized[rows] = values.to(torch.int8)
    return quantized, scales


def pair_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 (K % 32 == 0) -> [(N + 1) // 2, 2K]: rows 2p and 2p + 1 interleaved 32
    weights at a time, the layout the compiled GEMV streams (an odd N pads a zero row)."""
    rows, width = weight.shape
    padded = F.pad(weight, (0, 0, 0, rows % 2))  # [N rounded up to even, K]
    pairs = padded.view(-1, 2, width // PAIR_CHUNK, PAIR_CHUNK).transpose(1, 2)
    return pairs.contiguous().view(-1, 2 * width)  # [P, K/32, 2, 32] -> [P, 2K]


def unpair_rows(pairs: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """pair_rows undone, widened to `dtype` in the same copy: -> [rows, K]."""
    num_pairs, width = pairs.shape[0], pairs.shape[1] // 2
    plain = torch.empty(num_pairs, 2, width // PAIR_CHUNK, PAIR_CHUNK, dtype=dtype)
    plain.copy_(pairs.view(num_pairs, width // PAIR_CHUNK, 2, PAIR_CHUNK).transpose(1, 2))
    return plain.view(-1, width)[:rows]


def widen_gemv_layout(weight: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The GEMV's int8 weight (blocks [N/64, K/2, 64, 2] or row pairs) back to [rows, K],
    widened to `dtype` in the same copy."""
    if weight.dim() == 2:
        return unpair_rows(weight, rows, dtype)
    num_blocks, pairs, block_rows, _ = weight.shape
    plain = torch.empty(num_blocks, block_rows, pairs, 2, dtype=dtype)
    plain.copy_(weight.permute(0, 2, 1, 3))
    return plain.view(rows, 2 * pairs)


class Int8LinearMethod(LinearMethod):
    """`layer.int8_weight` int8 and `layer.int8_scales` [out]; no float weight.

    `gemv` is the compiled CPU kernel for decode steps (None: PyTorch's kernel instead). With
    it, the weight is stored in the GEMV's layout (flagged by `layer.int8_in_gemv_layout`):
    in blocks of 64 rows where `blocks` lays it out (the kernels' `int8_gemv_blocks`), else in
    row pairs (`pair_rows`, `in` a multiple of 32); the kernel reads the scales as float32
    (`layer.int8_gemv_scales`, the same values) in place. Otherwise the weight is [out, in].
    """

    def __init__(self, gemv: Gemv | None = None, blocks: BlockLayout | None = None) -> None:
        self.gemv = gemv
        self.blocks = blocks

    def gemv_layout(self, quantized: torch.Tensor) -> torch.Tensor | None:
        """`quantized` [out, in] as the GEMV reads it, or None where it cannot."""
        if self.gemv is None:
            return None
        laid_out = self.blocks(quantized) if self.blocks is not None else None
        if laid_out is None and quantized.shape[1] % PAIR_CHUNK == 0:
            laid_out = pair_rows(quantized)
        return laid_out

    def process_weights(self, layer: Linear) -> None:
        quantized, scales = quantize_int8(layer.weight.detach())
        layer.int8_scales = scales.to(layer.weight.dtype)
        laid_out = self.gemv_layout(quantized)
        layer.int8_in_gemv_layout = laid_out is not None  # type: ignore[assignment]  # a flag
        if laid_out is not None:
            layer.int8_weight = laid_out
            layer.int8_gemv_scales = layer.int8_scales.float()  # the same values, float32
        else:
            layer.int8_weight = quantized
        layer.weight = None  # type: ignore[assignment]  # the int8 copy replaces it

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        weight = cast(torch.Tensor, layer.int8_weight)
        scales = cast(torch.Tensor, layer.int8_scales)
        rows, in_features = x.shape
        decode_step = x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows <= MAX_ROWS
        if layer.int8_in_gemv_layout and decode_step:
            assert self.gemv is not None
            out = self.gemv(x, weight, cast(torch.Tensor, layer.int8_gemv_scales))
        elif layer.int8_in_gemv_layout:  # int8 -> bf16/fp16/fp32 is exact
            out = F.linear(x, widen_gemv_layout(weight, scales.numel(), x.dtype)) * scales
        elif decode_step and in_features % 32 == 0:  # PyTorch's kernel sums other widths wrongly
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight, scales)
        else:
            out = F.linear(x, weight.to(x.dtype)) * scales
        return out if layer.bias is None else out + layer.bias


def install_int8_linears(
    model: nn.Module,
    include_lm_head: bool = True,
    gemv: Gemv | None = None,
    blocks: BlockLayout | None = None,
) -> int:
    """Quantize every plain Linear of `model` (the LM head unless excluded); returns how many.

    `gemv` is the CPU's compiled decode kernel (`platforms/cpu`'s `int8_gemv`), where built, and
    `blocks` its block layout (`int8_gemv_blocks`).
    """
    method = Int8LinearMethod(gemv, blocks)
    lm_head = getattr(model, "lm_head", None)
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.method is DENSE and (include_lm_head or m is not lm_head)
    ]
    for layer in layers:
        layer.method = method
        method.process_weights(layer)
    logger.info(
        "int8 weights for %d linear layers (LM head %s); decode products by %s",
        len(layers),
        "included" if include_lm_head else "kept in the model dtype",
        "the compiled GEMV" if method.gemv else "PyTorch's kernels",
    )
    return len(layers)
