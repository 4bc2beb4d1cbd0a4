"""Int8MoeMethod: the experts in int8, each output row of each expert scaled into [-127, 127].

The same scheme as `quantization/int8.py`'s linears, per expert: `w13` becomes int8 [E, 2I, H]
with float32 scales [E, 2I], `w2` int8 [E, H, I] with [E, H]; the float weights go (one copy).
On CPU decode steps multiply through the C++ grouped int8 GEMV (`moe_int8_gemv`), which reads
each chosen expert's rows in pairs (`pair_rows`) and sums int8 * int16 exactly in int32; other
steps widen each chosen expert's int8 weight to the activations' dtype (exact) and scale the
product. The router stays in the model dtype: rounding it could change which experts win.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.moe.layer import MoeMethod, SparseMoeBlock, combine
from nanoserve.quantization.int8 import PAIR_CHUNK, pair_rows, quantize_int8, unpair_rows

GEMV_MAX_TOKENS = 8  # as the int8 linears' GEMV: each weight pair read once for all rows

# (x [A, K], pairs [E, N/2, 2K] int8, scales [E, N] float32, expert_ids [U], offsets [U + 1])
GroupedInt8Gemv = Callable[..., torch.Tensor]


class QuantizedExperts:
    """One stacked expert weight in int8: values ([E, N, K], or row pairs [E, N/2, 2K]) and
    float32 scales [E, N]."""

    def __init__(self, weight: torch.Tensor, paired: bool) -> None:  # weight [E, N, K]
        quantized = [quantize_int8(expert) for expert in weight.detach()]
        self.num_rows = weight.shape[1]
        self.scales = torch.stack([scales for _, scales in quantized])  # [E, N] float32
        values = [pair_rows(q) if paired else q for q, _ in quantized]
        self.values = torch.stack(values)  # [E, N, K] or [E, ceil(N/2), 2K] int8
        self.paired = paired

    def widened(self, expert: int, dtype: torch.dtype) -> torch.Tensor:  # -> [N, K] in dtype
        if self.paired:
            return unpair_rows(self.values[expert], self.num_rows, dtype)
        return self.values[expert].to(dtype)


class Int8MoeMethod(MoeMethod):
    """int8 experts (`layer.int8_w13`, `layer.int8_w2`); `gemv` is the CPU's grouped int8
    GEMV for decode steps (None: every step widens the chosen experts' weights)."""

    def __init__(self, gemv: GroupedInt8Gemv | None = None) -> None:
        self.gemv = gemv

    def process_weights(self, layer: SparseMoeBlock) -> None:
        hidden, inter = layer.w13.shape[2], layer.w2.shape[2]
        can_pair = self.gemv is not None and hidden % PAIR_CHUNK == 0 and inter % PAIR_CHUNK == 0
        layer.int8_w13 = QuantizedExperts(layer.w13, can_pair)  # type: ignore[assignment]
        layer.int8_w2 = QuantizedExperts(layer.w2, can_pair)  # type: ignore[assignment]
        layer.w13 = layer.w2 = None  # type: ignore[assignment]  # the int8 copies replace them

    def apply(self, layer: SparseMoeBlock, x, weights, expert_ids) -> torch.Tensor:
        groups = layer.group(weights, expert_ids)
        w13: QuantizedExperts = layer.int8_w13  # type: ignore[assignment]
        w2: QuantizedExperts = layer.int8_w2  # type: ignore[assignment]
        tokens = x[groups.token_index]  # [A, H]
        is_decode = x.device.type == "cpu" and x.dtype == torch.bfloat16
        if w13.paired and is_decode and x.shape[0] <= GEMV_MAX_TOKENS:
            assert self.gemv is not None
            ids, offsets = groups.expert_ids, groups.offsets
            gate_up = self.gemv(tokens, w13.values, w13.scales, ids, offsets)  # [A, 2I]
            act = layer.ops.silu_mul(gate_up)  # [A, I]
            return self.pairs.combine(x, groups, self.gemv(act, w2.values, w2.scales, ids, offsets))
        expert_out = x.new_empty(tokens.shape)  # [A, H]
        for expert, start, end in groups.spans():
            gate_up = F.linear(tokens[start:end], w13.widened(expert, x.dtype))
            gate_up = gate_up * w13.scales[expert].to(x.dtype)  # [n, 2I]
            down = F.linear(layer.ops.silu_mul(gate_up), w2.widened(expert, x.dtype))
            expert_out[start:end] = down * w2.scales[expert].to(x.dtype)
        return combine(x, groups, expert_out)
