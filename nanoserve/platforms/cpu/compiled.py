"""The compiled CPU attention backend (`--compile`): decode steps run under torch.compile.

Only decode-only steps are compiled (the model runner decides). There the KV write is an opaque
in-place custom op (traced as `index_copy_` it would copy the whole cache), and the attention is
written as gathers, products and reductions that inductor fuses into a few loops. Every other
step (prefill, mixed, or this backend run eagerly) takes the eager path.
"""

from __future__ import annotations

import torch

from nanoserve.core.attention.eager import EagerAttention, write_kv
from nanoserve.core.attention.metadata import AttentionMetadata


class CompiledCpuAttention(EagerAttention):
    """Eager attention, except inside a compiled decode step."""

    name = "cpu-compiled"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        if not torch.compiler.is_compiling():
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        assert meta.is_decode_only, "only decode-only steps run compiled"
        torch.ops.nanoserve.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)


def decode_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per request, written for torch.compile to fuse.

    Same result as the eager backend on a decode-only batch, but as gathers,
    products and reductions that inductor turns into a few loops (no padding indexes, no
    bf16 batched matmuls, which are slow on CPU at these shapes).
    """
    num_requests, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_context = block_tables.shape[1] * block_size
    shape = (num_requests, max_context, num_kv_heads, 1, head_dim)
    k = k_cache[block_tables].view(shape).float()  # [B, K, Hkv, 1, D]
    v = v_cache[block_tables].view(shape).float()  # [B, K, Hkv, 1, D]
    q = query.float().view(num_requests, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = (q * k).sum(-1) * scale  # [B, K, Hkv, group]
    key_positions = torch.arange(max_context, device=query.device)  # [K]
    is_visible = key_positions[None, :] < seq_lens[:, None]  # [B, K]
    scores = scores.masked_fill(~is_visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)  # over the keys
    out = (probs[..., None] * v).sum(1)  # [B, Hkv, group, D]
    return out.reshape(num_requests, num_heads, head_dim).to(query.dtype)


@torch.library.custom_op("nanoserve::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    write_kv(k, v, k_cache, v_cache, slot_mapping)
