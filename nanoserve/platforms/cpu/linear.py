"""The CPU linear method: weights packed once into oneDNN's blocked layout for bf16 matmuls.

`F.linear` on a plain bf16 weight makes oneDNN re-block the weight on every call. Packing it
once at start-up (what inductor's freezing pass does, and vLLM's CPU backend) makes every product
cheaper at every batch size, with bit-identical results (benchmarks/RESULTS.md, "Packed weights").

Decode steps of a few tokens are bound by how fast the weights stream from memory. On many
CPUs oneDNN's product streams them slower than our compiled GEMV (see `cpu_kernels`), which
reads its own copy of the weight, laid out as it reads it fastest (`bf16_gemv_weight`: in
blocks of 64 rows on AVX-512 BF16, `csrc/block_gemv.cpp`; in AMX's tiles where the CPU has them,
`csrc/amx_gemv.cpp`). The kernels' build times both (`gemv_max_rows`: up to how many tokens the
GEMV is faster). Where it is, each layer keeps that copy (`layer.gemv_weight`) beside the packed
one: products of up to that many tokens read it (decode steps, verify steps, short prompts),
longer prompts and larger batches the packed one
(so the linear weights take twice their memory; a tied LM head's embedding reads the GEMV's
copy, `tied_embedding.py`). Where it is not, only the packed weight is kept.

The packed weight is an opaque MKLDNN tensor; `torch.ops.mkldnn._linear_pointwise` multiplies
by it. Under torch.compile it is called through the `nanoserve::packed_linear` custom op, so that
inductor treats it as one extern kernel. With `--compile`, one-token products instead stream the
plain weight as a float32 reduction (`one_token_linear`), which inductor fuses with its
neighbours; the plain weight is then kept beside the packed one.

oneDNN packs bf16 weights only on CPUs with AVX-512 (or AVX-NE-CONVERT); most laptops have
AVX2 alone. There `F.linear` on bf16 runs several times slower than on float32, so
`WideningLinearMethod` keeps the bf16 weight (half the memory, half the bytes a decode step
streams through the GEMV) and widens it to float32 for the products of larger batches.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.core.layers.linear import DENSE, Linear, LinearMethod
from nanoserve.platforms.cpu.kernels import load_cpu_kernels

logger = logging.getLogger("nanoserve.cpu_linear")

# The batch size oneDNN tunes the blocked layout for; any number of rows works with it.
PACKING_BATCH_HINT = 8

# ([T, in], the weight as the GEMV's layout holds it) -> [T, out]
Gemv = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# [out, in] -> the GEMV's layout of it (the weight itself where the GEMV reads it plain)
GemvLayout = Callable[[torch.Tensor], torch.Tensor]


# Most rows one GEMV call takes (csrc/gemv.cpp unrolls 1 to 8).
GEMV_CALL_ROWS = 8
# Fewest tokens for which a product widens its bf16 weight to float32 (WideningLinearMethod):
# below it, the GEMV in calls of 8 rows streams the bf16 weight for less (or, without the
# GEMV, bf16 `F.linear` costs less than the widening).
WIDEN_MIN_ROWS = 32


@functools.cache
def packing_works() -> bool:
    """True when this torch build's oneDNN packs bf16 weights on this CPU (it needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT; asked by packing a small weight, not by reading flags)."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        pack(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False
    return True


def is_bf16_cpu(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def can_pack(weight: torch.Tensor) -> bool:
    """True for a bf16 weight on CPU when oneDNN can pack it here."""
    return is_bf16_cpu(weight) and packing_works()


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
    """oneDNN-packed bf16 weights (`layer.packed_weight`); the plain one only if kept.

    `gemv` is the compiled decode GEMV, for products of 1 to `gemv_max_rows` tokens (None or 0:
    every eager product is the packed one); it reads `layer.gemv_weight`, the weight as
    `gemv_layout` lays it out (the plain weight itself without one).
    """

    def __init__(
        self,
        keep_plain_weight: bool,
        gemv: Gemv | None = None,
        gemv_max_rows: int = 0,
        gemv_layout: GemvLayout | None = None,
    ) -> None:
        self.gemv = gemv if gemv_max_rows > 0 else None
        self.gemv_max_rows = gemv_max_rows if gemv is not None else 0
        self.gemv_layout = gemv_layout
        self.keep_plain_weight = keep_plain_weight

    def process_weights(self, layer: Linear) -> None:
        """Pack the weight, lay out the GEMV's copy, and drop the plain one unless kept (a tied
        weight lives on in its embedding)."""
        layer.packed_weight = pack(layer.weight)
        if self.gemv is not None:
            plain = layer.weight.detach()
            layer.gemv_weight = plain if self.gemv_layout is None else self.gemv_layout(plain)
        if not self.keep_plain_weight:
            layer.weight = None  # type: ignore[assignment]  # the packed copy replaces it

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if torch.compiler.is_compiling():
            if x.shape[0] == 1 and layer.weight is not None:
                return one_token_linear(x, layer.weight, layer.bias)
        elif self.gemv is not None and 1 <= x.shape[0] <= self.gemv_max_rows:
            out = self.gemv(x, cast(torch.Tensor, layer.gemv_weight))
            return out if layer.bias is None else out + layer.bias
        return packed_linear(x, cast(torch.Tensor, layer.packed_weight), layer.bias)


class WideningLinearMethod(LinearMethod):
    """bf16 weights on a CPU without oneDNN's bf16 packing: products of fewer than
    `WIDEN_MIN_ROWS` tokens stream the bf16 weight through the compiled GEMV (8 rows a call),
    larger ones widen it to float32 first (float32 sums either way, one rounding to bf16)."""

    def __init__(self, gemv: Gemv | None) -> None:
        self.gemv = gemv

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        rows = x.shape[0]
        if self.gemv is not None and 1 <= rows < WIDEN_MIN_ROWS:
            parts = [self.gemv(part, layer.weight) for part in x.split(GEMV_CALL_ROWS)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, out]
            return out if layer.bias is None else out + layer.bias
        if rows < WIDEN_MIN_ROWS or torch.compiler.is_compiling():
            return F.linear(x, layer.weight, layer.bias)
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(x.float(), layer.weight.float(), bias).to(x.dtype)


def decode_gemv() -> Gemv | None:
    """The compiled bf16 GEMV where it is built with SIMD here (AVX512-BF16, or AVX2 and FMA)."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.bf16_gemv_is_vectorized():
        return None
    return cast(Gemv, kernels.bf16_gemv)


def decode_gemv_layout() -> GemvLayout | None:
    """How the compiled GEMV lays out the weights it reads (None without the kernels)."""
    kernels = load_cpu_kernels()
    return None if kernels is None else cast(GemvLayout, kernels.bf16_gemv_weight)


def tuned_gemv_rows() -> int:
    """Up to how many tokens the GEMV beats oneDNN's packed product here (timed at build)."""
    kernels = load_cpu_kernels()
    return 0 if kernels is None else int(kernels.gemv_max_rows)


def install_cpu_linears(model: nn.Module, keep_plain_weights: bool) -> int:
    """Give every plain bf16 Linear of `model` the CPU's method: packed weights where oneDNN
    packs them here, else widened products. Returns how many layers changed."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    bf16 = [m for m in layers if m.method is DENSE and is_bf16_cpu(m.weight)]
    if not bf16:
        return 0
    gemv = decode_gemv()
    method: LinearMethod
    if packing_works():
        method = PackedLinearMethod(
            keep_plain_weights, gemv, tuned_gemv_rows(), decode_gemv_layout()
        )
        how = "packed for oneDNN"
    else:
        method = WideningLinearMethod(gemv)
        how = "kept in bf16 (this CPU's oneDNN cannot pack them), widened for large batches"
    for layer in bf16:
        layer.method = method
        method.process_weights(layer)
    logger.info("%d of %d linear weights %s; %s", len(bf16), len(layers), how, decode_how(method))
    return len(bf16)


def decode_how(method: LinearMethod) -> str:
    """What a decode step's products run on, for the log."""
    if isinstance(method, PackedLinearMethod):
        if method.gemv is None:
            return "every product by the packed one (as fast as the GEMV here)"
        return f"products of up to {method.gemv_max_rows} tokens by the compiled GEMV"
    gemv = isinstance(method, WideningLinearMethod) and method.gemv is not None
    return "decode steps by the compiled GEMV" if gemv else "decode steps by F.linear"


@torch.library.custom_op("nanoserve::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x, packed_weight, bias) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed_weight.shape[0])
