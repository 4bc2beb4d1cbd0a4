"""Paged attention: write this step's K/V into the block pool, then attend through block tables.

One forward pass serves a mixed batch: some requests bring many prompt tokens, others one decode
token. The runner flattens all their tokens into one sequence of `num_tokens` rows and describes
the layout once per step in `AttentionMetadata`; every layer reuses it.

The reference backend below is plain PyTorch and runs on CPU and CUDA. A faster backend (Triton,
FlashAttention) can replace `reference_paged_attention` behind the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto requests and KV slots.

    B = number of requests in the step, T = total tokens, Q = longest query, K = longest context.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64: each request's blocks (padded with 0)
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new tokens)
    query_lens: torch.Tensor  # [B] int64: tokens this request runs now
    query_pad_index: torch.Tensor  # [B, Q] int64: flat token index of each padded query row
    query_unpad_index: torch.Tensor  # [T] int64: row in the [B*Q] padded layout of each token
    attn_mask: torch.Tensor  # [B, 1, 1, Q, K] bool: True where a query may see a key
    is_decode_only: bool  # every request runs exactly one token (Q == 1)
    # A mixed step (decodes first, then prompt chunks) attends in two parts, so that decode
    # rows are not padded to [longest chunk x longest context]: (decode part, prompt part).
    parts: tuple[AttentionMetadata, AttentionMetadata] | None = None
    num_decode_tokens: int = 0


def reference_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Gather every request's context from the pool and attend with a causal, padded mask."""
    if meta.parts is not None:
        decode, prompt = meta.parts
        num_decode = meta.num_decode_tokens
        return torch.cat([
            reference_paged_attention(query[:num_decode], k_cache, v_cache, decode, scale),
            reference_paged_attention(query[num_decode:], k_cache, v_cache, prompt, scale),
        ])  # fmt: skip
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_requests, max_query_len = meta.query_pad_index.shape
    block_size = k_cache.shape[1]
    max_context = meta.block_tables.shape[1] * block_size

    # [B, Q, H, D] -> [B, Hkv, group, Q, D]: query heads grouped under the KV head they share.
    q = query[meta.query_pad_index]
    q = q.view(num_requests, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, 1, K, D]
    k = k_cache[meta.block_tables].view(num_requests, max_context, num_kv_heads, head_dim)
    v = v_cache[meta.block_tables].view(num_requests, max_context, num_kv_heads, head_dim)
    k = k.permute(0, 2, 1, 3).unsqueeze(2)
    v = v.permute(0, 2, 1, 3).unsqueeze(2)

    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, group, Q, K]
    scores = scores.masked_fill(~meta.attn_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, Hkv, group, Q, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(num_requests * max_query_len, num_heads, head_dim)
    return out[meta.query_unpad_index]  # [T, H, D]


class PagedAttention(nn.Module):
    """Attention over the paged KV cache; the runner binds `k_cache`/`v_cache` after allocating."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        assert self.k_cache is not None, "KV cache not bound: call ModelRunner.bind_kv_cache"
        if torch.compiler.is_compiling() and meta.is_decode_only:
            # The cache write is an opaque in-place op (traced, index_copy_ would copy the
            # whole cache); the attention itself is traced, so inductor fuses it.
            torch.ops.nanoserve.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return decode_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale
            )
        if torch.compiler.is_compiling():
            # Any other batch: the cache write and the attention are one opaque op.
            return torch.ops.nanoserve.paged_attention(
                q, k, v, self.k_cache, self.v_cache, *_meta_tensors(meta), self.scale
            )
        return write_kv_and_attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)


def write_kv_and_attend(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Write this step's keys and values into their slots, then attend over each context."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    return reference_paged_attention(q, k_cache, v_cache, meta, scale)


def decode_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per request, written for torch.compile to fuse.

    Same result as `reference_paged_attention` on a decode-only batch, but as gathers,
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
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _meta_tensors(meta: AttentionMetadata) -> list[torch.Tensor]:
    return [
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.query_lens,
        meta.query_pad_index,
        meta.query_unpad_index,
        meta.attn_mask,
    ]


@torch.library.custom_op("nanoserve::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    query_pad_index: torch.Tensor,
    query_unpad_index: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    meta = AttentionMetadata(
        slot_mapping,
        block_tables,
        seq_lens,
        query_lens,
        query_pad_index,
        query_unpad_index,
        attn_mask,
        is_decode_only=query_pad_index.shape[1] == 1,
    )
    return write_kv_and_attend(q, k, v, k_cache, v_cache, meta, scale)


@_paged_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, *meta_and_scale) -> torch.Tensor:
    return torch.empty_like(q)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build the per-step layout once on the CPU side; every layer reads it.

    When one-token (decode) requests come first and prompt chunks follow, the step also gets
    two parts that attend separately (see `AttentionMetadata.parts`).
    """
    meta = _build_group(query_lens, seq_lens, block_tables, slot_mapping, block_size, device)
    num_decodes = next((i for i, n in enumerate(query_lens) if n > 1), len(query_lens))
    if 0 < num_decodes < len(query_lens) and all(n > 1 for n in query_lens[num_decodes:]):
        # Decode requests run one token each, so one slice cuts every per-request and
        # per-token list at the same place.
        decode, prompt = (
            _build_group(query_lens[part], seq_lens[part], block_tables[part],
                         slot_mapping[part], block_size, device)
            for part in (slice(None, num_decodes), slice(num_decodes, None))
        )  # fmt: skip
        meta.parts = (decode, prompt)
        meta.num_decode_tokens = num_decodes
    return meta


def _build_group(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    num_requests = len(query_lens)
    max_query_len = max(query_lens)
    max_blocks = max(len(t) for t in block_tables)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    starts = torch.cumsum(query_lens_t, 0) - query_lens_t  # [B] first flat index of each request

    offsets = torch.arange(max_query_len)  # [Q]
    is_real_query = offsets[None, :] < query_lens_t[:, None]  # [B, Q]
    query_pad_index = torch.where(is_real_query, starts[:, None] + offsets[None, :], 0)
    padded_rows = torch.arange(num_requests)[:, None] * max_query_len + offsets[None, :]
    query_unpad_index = padded_rows[is_real_query]  # [T], in flat token order

    # Position of each query within its own sequence; a key at position j is visible if j <= it.
    query_positions = (seq_lens_t - query_lens_t)[:, None] + offsets[None, :]  # [B, Q]
    key_positions = torch.arange(max_blocks * block_size)
    attn_mask = key_positions[None, None, :] <= query_positions[:, :, None]  # [B, Q, K]
    attn_mask &= key_positions[None, None, :] < seq_lens_t[:, None, None]
    attn_mask[~is_real_query] = False
    attn_mask[:, :, 0] |= ~is_real_query  # padding rows see one key, so softmax stays finite

    table = torch.zeros(num_requests, max_blocks, dtype=torch.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)

    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device),
        block_tables=table.to(device),
        seq_lens=seq_lens_t.to(device),
        query_lens=query_lens_t.to(device),
        query_pad_index=query_pad_index.to(device),
        query_unpad_index=query_unpad_index.to(device),
        attn_mask=attn_mask[:, None, None].to(device),
        is_decode_only=max_query_len == 1,
    )
