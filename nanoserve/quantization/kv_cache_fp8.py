"""FP8 KV cache (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`): one byte per key and value.

A cached value is `round(x / scale)` to the FP8 type, saturated at its largest finite value
(448 in e4m3, 57344 in e5m2): an outlier is clipped, never stored as NaN or inf. Each layer has
one scale for its keys and one for its values (`KVScales`), chosen in this order:

1. the checkpoint's, where it carries them (`self_attn.k_scale` / `v_scale`, the older
   `kv_scale` for both, or `k_proj.output_scale` / `v_proj.output_scale`, as FP8 checkpoints
   with a quantized KV cache do): `KVScaleReader` takes them out of the weights as they load;
2. with `--calculate-kv-scales`, measured on the first prompt step that writes at least
   `CALIBRATION_MIN_TOKENS` keys (the engine's warm-up writes fewer): |max| / 200 for K and
   / 100 for V, vLLM's constants, which leave room for larger values later;
3. else 1.0, vLLM's default, right for models whose keys and values stay within FP8's range.

Nothing is dequantized in memory: the scales fold into attention. With K = k_scale * Kq,
q . K = (k_scale * q) . Kq, and sum p V = v_scale * sum p Vq, so `Fp8KVAttention` wraps the
platform's backend, quantizes the step's keys and values, scales the queries before and the
output after; the wrapped backend stores the FP8 bytes and widens them as it reads (the
reference's torch ops, the C++ decode kernel, the Triton kernels). The scales are device
tensors updated in place, so a captured CUDA graph reads the current ones.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nanoserve.common.config import ModelConfig
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.fast_paths import FastPaths
from nanoserve.core.loader import WeightReader
from nanoserve.core.models.base import CausalLM

logger = logging.getLogger("nanoserve.kv_cache_fp8")

KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0  # vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT
CALIBRATION_MIN_TOKENS = 32
REQUANTIZE_BLOCKS = 256  # blocks widened at a time when calibration rescales what is stored

# Checkpoint names of a layer's KV scales -> which of (K, V) they set.
_SCALE_NAME = re.compile(
    r"(?:model\.)?layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|"
    r"k_proj\.output_scale|v_proj\.output_scale)$"
)
_TARGETS = {
    "k_scale": "k",
    "v_scale": "v",
    "kv_scale": "kv",
    "k_proj.output_scale": "k",
    "v_proj.output_scale": "v",
}


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x / scale (None: 1) as `dtype`, rounded to nearest and saturated at its finite range."""
    limit = torch.finfo(dtype).max
    scaled = x if scale is None else x.float() / scale
    return scaled.clamp(-limit, limit).to(dtype)


class KVScales:
    """Each layer's K and V scale ([num_layers] float32 on the device), and which layers still
    wait for theirs to be measured."""

    def __init__(
        self,
        num_layers: int,
        device: torch.device,
        checkpoint: dict[int, dict[str, float]] | None = None,
        calculate: bool = False,
    ) -> None:
        self.k = torch.ones(num_layers, dtype=torch.float32, device=device)
        self.v = torch.ones(num_layers, dtype=torch.float32, device=device)
        for layer, scales in (checkpoint or {}).items():
            self.k[layer] = scales.get("k", 1.0)
            self.v[layer] = scales.get("v", 1.0)
        self.pending = set(range(num_layers)) if calculate and not checkpoint else set()
        # Scales that are all 1.0 for good: no multiply or divide is needed at all.
        self.is_identity = not self.pending and bool((self.k == 1).all() and (self.v == 1).all())

    def source(self) -> str:
        if self.pending:
            return "measured on the first prompt step"
        return "1.0" if self.is_identity else "the checkpoint's"

    def calibrate(
        self,
        layer: int,
        k: torch.Tensor,  # [T, Hkv, D]: the step's keys
        v: torch.Tensor,  # [T, Hkv, D]
        caches: tuple[torch.Tensor, torch.Tensor],  # the layer's FP8 K and V pool
    ) -> None:
        """Layer `layer`'s scales from this step's keys and values; what the pool already holds
        (stored with the old scales) is stored again with the new ones."""
        for scale, x, limit, cache in (
            (self.k, k, K_SCALE_RANGE, caches[0]),
            (self.v, v, V_SCALE_RANGE, caches[1]),
        ):
            amax = x.abs().max().float()
            new = torch.where(amax > 0, amax / limit, scale[layer])
            for start in range(0, cache.shape[0], REQUANTIZE_BLOCKS):
                part = cache[start : start + REQUANTIZE_BLOCKS]
                part.copy_(quantize(part.float() * scale[layer], new, cache.dtype))
            scale[layer] = new
        self.pending.discard(layer)
        logger.info(
            "layer %d: KV scales k %.4g, v %.4g (from %d tokens)",
            layer,
            self.k[layer].item(),
            self.v[layer].item(),
            k.shape[0],
        )


class Fp8KVAttention(AttentionBackend):
    """A backend whose KV pool holds FP8: quantizes on write, folds the scales into attention;
    the wrapped backend stores the bytes and widens them as it reads."""

    def __init__(
        self,
        inner: AttentionBackend,
        dtype: torch.dtype,
        scales: KVScales,
        layer: int | None = None,  # None: a pool of no layer (a profiling pass): scales 1.0
    ) -> None:
        self.inner, self.scales, self.layer = inner, scales, layer
        self.dtype = self.kv_cache_dtype = dtype
        self.name = f"{inner.name}, {str(dtype).removeprefix('torch.')} KV cache"

    def for_layer(self, index: int) -> AttentionBackend:
        return Fp8KVAttention(self.inner.for_layer(index), self.dtype, self.scales, index)

    def build_metadata(self, layout: Any, block_size: int, device: torch.device) -> Any:
        return self.inner.build_metadata(layout, block_size, device)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] FP8
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] FP8
        meta: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        layer, dtype = self.layer, self.dtype
        is_prompt_step = not meta.is_decode_only and k.shape[0] >= CALIBRATION_MIN_TOKENS
        if layer in self.scales.pending and is_prompt_step:
            assert layer is not None
            self.scales.calibrate(layer, k, v, (k_cache, v_cache))
        if self.scales.is_identity or layer is None:
            k_q, v_q = quantize(k, None, dtype), quantize(v, None, dtype)
            return self.inner.forward(q, k_q, v_q, k_cache, v_cache, meta, scale)
        k_scale, v_scale = self.scales.k[layer], self.scales.v[layer]  # 0-dim: keep q's dtype
        k_q, v_q = quantize(k, k_scale, dtype), quantize(v, v_scale, dtype)
        out = self.inner.forward(q * k_scale, k_q, v_q, k_cache, v_cache, meta, scale)
        return out * v_scale


class KVScaleReader(WeightReader):
    """A checkpoint reader that takes the layers' KV scales out of the weights (into
    `scales`, layer -> {"k": ..., "v": ...}) and reads everything else with `inner`."""

    def __init__(self, inner: WeightReader, scales: dict[int, dict[str, float]]) -> None:
        self.inner, self.scales = inner, scales

    def open(self, files: list[Path]) -> None:
        self.inner.open(files)
        for file in files:  # scalars: read them all first
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    match = _SCALE_NAME.search(name)
                    if match is not None:
                        value = float(f.get_tensor(name).float().max())
                        for target in _TARGETS[match.group(2)]:
                            self.scales.setdefault(int(match.group(1)), {})[target] = value

    def is_weight(self, name: str) -> bool:
        return _SCALE_NAME.search(name) is None and self.inner.is_weight(name)

    def read(self, handle, name: str, source) -> torch.Tensor:
        return self.inner.read(handle, name, source)


def with_kv_cache_dtype(paths: FastPaths, kv_cache_dtype: str, calculate: bool) -> FastPaths:
    """`paths` with checkpoint KV scales kept out of the weights (whatever the cache's dtype),
    and for an FP8 cache the platform's attention backend wrapped in `Fp8KVAttention`."""
    checkpoint_scales: dict[int, dict[str, float]] = {}  # filled while the weights load
    make_reader, make_backend = paths.weight_reader, paths.attention_backend

    def weight_reader(model_config: ModelConfig) -> WeightReader:
        return KVScaleReader(make_reader(model_config), checkpoint_scales)

    def attention_backend(model: CausalLM) -> AttentionBackend:
        dtype = KV_CACHE_DTYPES[kv_cache_dtype]
        device = next(model.parameters()).device
        scales = KVScales(len(model.attention_layers()), device, checkpoint_scales, calculate)
        logger.info("KV cache in %s, scales %s", str(dtype).removeprefix("torch."), scales.source())
        return Fp8KVAttention(make_backend(model), dtype, scales)

    if kv_cache_dtype == "auto":
        return dataclasses.replace(paths, weight_reader=weight_reader)
    return dataclasses.replace(
        paths, weight_reader=weight_reader, attention_backend=attention_backend
    )
