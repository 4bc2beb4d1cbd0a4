"""The reference attention backend: plain PyTorch, on CPU and CUDA, the one every other backend
is tested against.

- decode tokens (one query per request) attend in one padded, batched pass over the gathered
  contexts (`decode_group_attention`; a lone request through `F.scaled_dot_product_attention`);
- prompt tokens attend request by request with `F.scaled_dot_product_attention` (CPU's flash
  kernel), causal within the new tokens and over all of a cached prefix (`prompt_attention`,
  each chunk through `chunk_attention`).

Its metadata adds the masks and gather indices it attends with to the shared fields, and splits a
mixed step (decodes first, then prompt chunks) into two parts that attend separately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from nanoserve.core.step_layout import StepLayout


@dataclass
class ReferenceMetadata(AttentionMetadata):
    """The shared fields plus what the reference backend attends with (K = longest context)."""

    # Decode groups: [B, 1, 1, K] bool, True where a key is inside the request's context, and
    # [B, K] int64, the KV slot of each key position (block_id * block_size + offset).
    decode_mask: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    # Prompt groups: per request, [Q_i, K_i] bool (True: the query sees the key), or None
    # when the request has no cached prefix (Q_i == K_i: plain causal attention).
    prompt_masks: list[torch.Tensor | None] | None = None
    # A mixed step (decodes first, then prompt chunks) attends in two parts: (decode, prompt).
    parts: tuple[ReferenceMetadata, ReferenceMetadata] | None = None
    num_decode_tokens: int = 0


# (query [B, H, D], k_cache, v_cache, meta, scale) -> [B, H, D]: how decode tokens attend.
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, ReferenceMetadata, float], torch.Tensor
]


# (queries [Q, H, D], keys [K, Hkv, D], values [K, Hkv, D], mask [Q, K] or None, scale) ->
# [Q, H, D]: how one prompt chunk attends over its context (None: plain causal, Q == K).
ChunkAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor
]


def chunk_attention(
    query: torch.Tensor,  # [Q, H, D]
    key: torch.Tensor,  # [K, Hkv, D]
    value: torch.Tensor,  # [K, Hkv, D]
    mask: torch.Tensor | None,  # [Q, K]: True where the query sees the key; None: causal
    scale: float,
) -> torch.Tensor:  # [Q, H, D]
    """One SDPA call (CPU's flash kernel takes the mask and grouped heads as they are)."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, H, Q, D]
        key.transpose(0, 1)[None],  # [1, Hkv, K, D]
        value.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, Q, D]
    return out[0].transpose(0, 1)  # [Q, H, D] (SDPA's own layout: contiguous)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T]: flat slot (block_id * block_size + offset) per token
) -> None:
    """Store each token's key and value in its slot of the pool."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_cache.element_size() == 1:  # fp8 (K and V already are): CPU has no fp8 index_copy_
        k, v, k_cache, v_cache = (t.view(torch.uint8) for t in (k, v, k_cache, v_cache))
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class ReferenceAttention(AttentionBackend):
    """Index-copy the new K/V into their slots, then attend with plain torch ops."""

    name = "reference"
    store_kv = staticmethod(write_kv)  # how the new K/V enter the pool (subclasses: kernels)
    attend_chunk = staticmethod(chunk_attention)  # how a prompt chunk attends (subclasses: kernels)

    def build_metadata(
        self, layout: StepLayout, block_size: int, device: torch.device
    ) -> ReferenceMetadata:
        return build_reference_metadata(
            layout.query_lens,
            layout.seq_lens,
            layout.block_tables,
            layout.slot_mapping,
            block_size,
            device,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: ReferenceMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attend = (self.attend_decodes, self.attend_chunk)  # kernels a subclass may bring
        return paged_attention(q, k_cache, v_cache, meta, scale, (k, v), *attend)

    def attend_decodes(
        self,
        query: torch.Tensor,  # [B, H, D]: one query token per request
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: ReferenceMetadata,
        scale: float,
    ) -> torch.Tensor:  # [B, H, D]
        """How a step's decode tokens attend (subclasses may bring a kernel)."""
        return decode_group_attention(query, k_cache, v_cache, meta, scale)


def build_reference_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device | str,
) -> ReferenceMetadata:
    """The step's metadata with the masks and gather indices; a step of decodes followed by
    prompt chunks also gets its two parts (see `ReferenceMetadata.parts`)."""
    meta = ReferenceMetadata.build(query_lens, seq_lens, block_tables, slot_mapping, device)
    meta = _with_masks(meta, block_size)
    num_decodes = next((i for i, n in enumerate(query_lens) if n > 1), len(query_lens))
    if 0 < num_decodes < len(query_lens) and all(n > 1 for n in query_lens[num_decodes:]):
        # Decode requests run one token each, so one slice cuts every per-request and
        # per-token list at the same place.
        decode, prompt = (
            ReferenceMetadata.build(
                query_lens[part], seq_lens[part], block_tables[part], slot_mapping[part], device
            )
            for part in (slice(None, num_decodes), slice(num_decodes, None))
        )
        decode, prompt = _with_masks(decode, block_size), _with_masks(prompt, block_size)
        meta.parts = (decode, prompt)
        meta.num_decode_tokens = num_decodes
    return meta


def _with_masks(meta: ReferenceMetadata, block_size: int) -> ReferenceMetadata:
    """Add the decode group's mask and key slots, or each prompt's mask (on meta's device)."""
    device = meta.seq_lens.device
    if meta.is_decode_only:
        key_positions = torch.arange(meta.block_tables.shape[1] * block_size, device=device)
        meta.decode_mask = (key_positions[None, :] < meta.seq_lens[:, None])[:, None, None]
        offsets = torch.arange(block_size, device=device)
        slots = meta.block_tables[:, :, None] * block_size + offsets  # [B, max_blocks, block]
        meta.decode_slots = slots.view(len(meta.query_lens_list), -1)  # [B, K]
        return meta
    # A query at position p (within its sequence) sees keys at positions <= p.
    meta.prompt_masks = []
    for num_queries, num_keys in zip(meta.query_lens_list, meta.seq_lens_list, strict=True):
        if num_queries == num_keys:
            meta.prompt_masks.append(None)  # no cached prefix: plain causal
            continue
        query_positions = torch.arange(num_keys - num_queries, num_keys, device=device)
        key_positions = torch.arange(num_keys, device=device)
        meta.prompt_masks.append(key_positions[None, :] <= query_positions[:, None])  # [Q, K]
    return meta


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: ReferenceMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's [T, Hkv, D] K and V
    attend_decodes: DecodeAttention | None = None,  # default: decode_group_attention
    attend_chunk: ChunkAttention | None = None,  # default: chunk_attention
) -> torch.Tensor:  # [T, H, D]
    """Attend every query token over its request's context in the pool.

    `new_kv` (already written to the pool) lets a prompt with no cached prefix, whose context
    is exactly its own new tokens, attend over them without gathering them back.
    """
    attend_decodes = attend_decodes or decode_group_attention
    if meta.parts is not None:
        decode, prompt = meta.parts
        n = meta.num_decode_tokens
        prompt_kv = None if new_kv is None else (new_kv[0][n:], new_kv[1][n:])
        decodes = attend_decodes(query[:n], k_cache, v_cache, decode, scale)  # [n, H, D]
        prompts = prompt_attention(
            query[n:], k_cache, v_cache, prompt, scale, prompt_kv, attend_chunk
        )
        return torch.cat([decodes, prompts])  # [T, H, D]
    if meta.is_decode_only:
        return attend_decodes(query, k_cache, v_cache, meta, scale)
    return prompt_attention(query, k_cache, v_cache, meta, scale, new_kv, attend_chunk)


def decode_group_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: ReferenceMetadata,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Gather every request's context, padded to the longest, and attend in one batched pass.

    The gather reads K/V rows straight into a head-major [B, Hkv, K, D] layout, so both products
    are plain batched matmuls over (request, KV head), with no broadcast copies of the context.
    """
    assert meta.decode_slots is not None and meta.decode_mask is not None, "not a decode group"
    num_requests, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    kv_heads = torch.arange(num_kv_heads, device=query.device)
    # Row of each (request, KV head, key) in the cache viewed as [num_slots * Hkv, D].
    rows = meta.decode_slots[:, None, :] * num_kv_heads + kv_heads[None, :, None]  # [B, Hkv, K]
    context_shape, flat_rows = (*rows.shape, head_dim), rows.flatten()
    # index_select copies whole rows: on CPU 3-10x faster than advanced indexing, same values.
    k = k_cache.view(-1, head_dim).index_select(0, flat_rows).view(context_shape)  # [B, Hkv, K, D]
    v = v_cache.view(-1, head_dim).index_select(0, flat_rows).view(context_shape)  # [B, Hkv, K, D]
    k, v = k.to(query.dtype), v.to(query.dtype)  # a narrower cache (fp8) widens here
    # [B, H, D] -> [B, Hkv, group, D]: query heads grouped under the KV head they share.
    q = query.view(num_requests, num_kv_heads, group, head_dim)
    if num_requests == 1:  # one stream: SDPA's fused kernel is 2-4x the three ops below on CPU
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale)
        return out.reshape(num_requests, num_heads, head_dim)  # [1, H, D]

    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, group, K]
    scores = scores.masked_fill(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, Hkv, group, D]
    return out.reshape(num_requests, num_heads, head_dim)


def prompt_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: ReferenceMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's [T, Hkv, D] K and V
    attend_chunk: ChunkAttention | None = None,  # default: chunk_attention
) -> torch.Tensor:  # [T, H, D]
    """Request by request: gather the context (cached prefix + new tokens), then attend.

    Without padding, a prompt chunk costs what its own queries and context cost, whatever else
    runs in the step. A prompt without a cached prefix attends over `new_kv` directly when given
    (no gather).
    """
    assert meta.prompt_masks is not None, "not a prompt group"
    attend_chunk = attend_chunk or chunk_attention
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    outputs = []
    start = 0
    for index, (num_queries, num_keys) in enumerate(
        zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
    ):
        mask = meta.prompt_masks[index]
        if mask is None and new_kv is not None:  # the context is the new tokens themselves
            k = new_kv[0][start : start + num_queries]  # [K_i, Hkv, D]
            v = new_kv[1][start : start + num_queries]
        else:
            blocks = meta.block_tables[index, : -(-num_keys // block_size)]
            k = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:num_keys]
            v = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:num_keys]
        q = query[start : start + num_queries]  # [Q_i, H, D]
        outputs.append(attend_chunk(q, k.to(q.dtype), v.to(q.dtype), mask, scale))  # fp8 widened
        start += num_queries
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
