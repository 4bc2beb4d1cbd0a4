"""Block-scaled FP8 checkpoints (`quantization_config.quant_method == "fp8"`).

Such a checkpoint stores each linear weight as float8_e4m3fn [out, in] beside
`<name>_scale_inv` float32 [ceil(out / bo), ceil(in / bi)]: block (i, j) of the weight,
`weight_block_size` = [bo, bi] (128 × 128 in Qwen3-*-FP8 and DeepSeek), is its FP8 values
times that block's scale. The loader dequantizes each weight as it streams in (`dequantize`), so
the model holds the model dtype (or int8, with `--quantization int8`): `Fp8WeightReader`, the
loader's reader for this format. On CUDA GPUs with FP8 matrix units the weights can instead stay
in 8 bits (`Fp8LinearMethod`).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from nanoserve.common.config import ModelConfig
from nanoserve.core.layers.linear import DENSE, CheckpointSlice, Linear, LinearMethod
from nanoserve.core.loader import WeightReader

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale_inv"


def dequantize(
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out / bo), ceil(in / bi)] float32
    block_size: tuple[int, int],
) -> torch.Tensor:  # [out, in] float32
    """The weight a block-scaled FP8 tensor stands for."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    scales = scale_inv.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return weight.float() * scales[:rows, :cols]


def quantize(
    weight: torch.Tensor, block_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-scaled FP8 form of `weight` [out, in]: (FP8 values, per-block scale_inv)."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    padded = torch.zeros(
        -(-rows // block_rows) * block_rows, -(-cols // block_cols) * block_cols
    )  # [R * bo, C * bi]
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // block_rows, block_rows, -1, block_cols)
    absmax = blocks.abs().amax(dim=(1, 3))  # [R, C]
    scale_inv = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    expanded = scale_inv.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    values = (padded / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8)[:rows, :cols]
    return values.contiguous(), scale_inv


def block_size_of(quantization: dict | None) -> tuple[int, int] | None:
    """The [bo, bi] of an FP8 `quantization_config`, or None for an unquantized checkpoint."""
    if not quantization or quantization.get("quant_method") != "fp8":
        return None
    rows, cols = quantization.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


class Fp8WeightReader(WeightReader):
    """Reads a block-scaled FP8 checkpoint: each weight dequantized with its `*_scale_inv`."""

    def __init__(self, block_size: tuple[int, int]) -> None:
        self.block_size = block_size
        self.scales: dict[str, torch.Tensor] = {}  # weight name -> its block scales

    def open(self, files: list[Path]) -> None:
        for file in files:  # the scales are small: read them all first
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.endswith(SCALE_SUFFIX):
                        self.scales[name.removesuffix(SCALE_SUFFIX)] = f.get_tensor(name)

    def is_weight(self, name: str) -> bool:
        return not name.endswith(SCALE_SUFFIX)

    def read(self, handle, name: str, source: CheckpointSlice | None) -> torch.Tensor:
        """A scaled weight is read whole and dequantized first (its blocks straddle shards)."""
        if name not in self.scales:
            return super().read(handle, name, source)
        tensor = dequantize(handle.get_tensor(name), self.scales[name], self.block_size)
        return tensor if source is None else tensor.narrow(source.dim, source.start, source.length)


def weight_reader_for(model_config: ModelConfig) -> WeightReader:
    """The reader for this checkpoint: FP8's where its config says so, else the plain one."""
    block_size = block_size_of(model_config.quantization)
    return WeightReader() if block_size is None else Fp8WeightReader(block_size)


class Fp8LinearMethod(LinearMethod):
    """FP8 weights with a scale per output row, FP8 activations scaled per token (CUDA only).

    `torch._scaled_mm` multiplies two FP8 matrices on the tensor cores of GPUs with compute
    capability ≥ 8.9 and applies both scales to the float32 accumulator.
    """

    def process_weights(self, layer: Linear) -> None:
        weight = layer.weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [out]
        layer.fp8_weight = (weight / scales[:, None]).to(FP8)  # [out, in] row-major
        layer.fp8_scales = scales[None, :]  # [1, out] float32
        layer.weight = None  # type: ignore[assignment]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        num_tokens = x.shape[0]
        padded = -(-num_tokens // 16) * 16  # the FP8 GEMM wants rows in multiples of 16
        x_scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        x_fp8 = torch.zeros(padded, x.shape[1], dtype=FP8, device=x.device)
        x_fp8[:num_tokens] = (x.float() / x_scales).to(FP8)
        a_scales = torch.ones(padded, 1, device=x.device)
        a_scales[:num_tokens] = x_scales
        weight = cast(torch.Tensor, layer.fp8_weight)  # [out, in]
        weight_scales = cast(torch.Tensor, layer.fp8_scales)  # [1, out]
        out = torch._scaled_mm(
            x_fp8, weight.t(), scale_a=a_scales, scale_b=weight_scales, out_dtype=x.dtype
        )[:num_tokens]
        return out if layer.bias is None else out + layer.bias


def can_use_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def install_fp8_linears(model: torch.nn.Module) -> int:
    """FP8 products for every plain Linear but the LM head (kept in the model dtype)."""
    method = Fp8LinearMethod()
    lm_head = getattr(model, "lm_head", None)
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.method is DENSE and m is not lm_head
    ]
    for layer in layers:
        layer.method = method
        method.process_weights(layer)
    return len(layers)
