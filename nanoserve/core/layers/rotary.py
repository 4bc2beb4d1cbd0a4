"""Rotary position embeddings (RoPE), "neox" style: the head is split into two halves.

The cos/sin table is computed once in float32 for every position up to
`max_position_embeddings` and indexed by each token's position, so a batch can mix tokens of
many requests at arbitrary positions. Each step looks up its positions once and casts them to
the model's dtype (as transformers does before multiplying); every layer then reuses them.
The rotation itself is `layers/ops.py`'s `apply_rotary`."""

from __future__ import annotations

import math

import torch
from torch import nn

from nanoserve.common.checkpoint import check_rope_scaling


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """The rotation frequency of each pair of dimensions: [head_dim // 2] float32."""
    check_rope_scaling(rope_scaling)
    # Built on the CPU even when the model itself is built on the meta device.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)  # [D/2]
    if rope_scaling is None or rope_scaling.get("rope_type", "default") == "default":
        return inv_freq
    if rope_scaling["rope_type"] == "linear":
        return inv_freq / rope_scaling["factor"]
    return _llama3_inv_freq(inv_freq, rope_scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1+: slow down low frequencies by `factor`, keep high ones, blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Looks up cos/sin for token positions from a float32 table built once."""

    cos_cache: torch.Tensor  # [max_position, D/2] float32 (a buffer)
    sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)  # [D/2]
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")  # [P]
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        self.max_position = max_position
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [P, D/2] float32
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)  # [P, D/2] float32

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed_sin), each [T, 1, D] in `dtype`, for `apply_rotary`
        (`layers/ops.py`).

        Looked up and cast once per step, then shared by every layer. `signed_sin` is
        [-sin, sin]: the sign of the "rotate half" trick folded into the table.
        """
        cos = self.cos_cache[positions]  # [T, D/2] float32
        sin = self.sin_cache[positions]  # [T, D/2] float32
        cos = torch.cat((cos, cos), dim=-1).to(dtype)  # [T, D]
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # [T, D]
        return cos[:, None], signed_sin[:, None]
