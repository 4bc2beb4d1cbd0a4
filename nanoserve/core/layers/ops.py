"""The elementwise ops of the model's layers: RMSNorm's normalization, the rotary embedding (with
Qwen3's q/k norms before it) and SwiGLU's activation, in plain PyTorch.

A layer that uses them holds an `ops` attribute (`PORTABLE_OPS` by default). A platform may
install fused kernels in their place, layer by layer (`install_layer_ops`); those compute the
same roundings in fewer passes. The model file calls `self.ops.<op>` and never asks which it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from nanoserve.core.layers.norm import RMSNorm  # which calls these ops


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D] -> [..., D]
    """x / rms(x) over the last dim, computed in float32 and rounded back to x's dtype.

    This is RMSNorm without its learned scale: transformers rounds to the input dtype *before*
    scaling, so callers multiply by the weight afterwards (and may use one weight per head).
    """
    input_dtype = x.dtype
    x = x.float()
    variance = x.pow(2).mean(-1, keepdim=True)  # [..., 1]
    return (x * torch.rsqrt(variance + eps)).to(input_dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x [T, H, D] by its token's angle; cos/signed_sin are [T, 1, D].

    transformers computes x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1].
    Here the halves are swapped to [x2, x1] and the signed table supplies the minus: the same
    arithmetic, rounding included, in fewer ops. (`torch.roll` would say the same but compiles
    to a slower decode step: inductor inlines it into the attention loop.)
    """
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin  # [T, H, D]


class LayerOps:
    """The portable ops; a platform's subclass may take some inputs through its kernels."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:  # [..., D] -> [..., D]
        """RMSNorm over the last dim, scaled by `weight` (None: unscaled, as q/k norms use)."""
        normalized = rms_normalize(x, eps)
        return normalized if weight is None else weight * normalized

    def rotary(
        self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:  # [T, H, D] -> [T, H, D]
        return apply_rotary(x, cos, signed_sin)

    def qk_norm_rotary(
        self,
        qk: torch.Tensor,  # [T, H + Hkv, D]: a step's query heads, then its key heads
        num_heads: int,  # H
        norms: tuple[RMSNorm, RMSNorm] | None,  # the q and k norms (Qwen3), or None
        cos: torch.Tensor,  # [T, 1, D]
        signed_sin: torch.Tensor,  # [T, 1, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H, D], k [T, Hkv, D]
        """Each head RMS-normed by its norm (where there are norms), then rotated."""
        if norms is not None:  # one normalization covers every head; then a weight per side
            qk = self.rms_norm(qk, None, norms[0].eps)
        q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
        if norms is not None:
            # Scaling (and rotating) q and k apart compiles to a faster decode step than one
            # joint-head op: inductor inlines q's arithmetic into the attention loop.
            q, k = norms[0].weight * q, norms[1].weight * k
        return self.rotary(q, cos, signed_sin), self.rotary(k, cos, signed_sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        """SwiGLU's silu(gate) * up, the gate and up halves side by side."""
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up


PORTABLE_OPS = LayerOps()


def install_layer_ops(model: nn.Module, ops: LayerOps) -> int:
    """Give every layer of `model` that calls layer ops these `ops`; returns how many."""
    users = [m for m in model.modules() if isinstance(getattr(m, "ops", None), LayerOps)]
    for module in users:
        cast(Any, module).ops = ops  # an attribute, not a submodule
    return len(users)
