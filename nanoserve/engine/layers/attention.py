"""Paged attention: write this step's K/V into the block pool, then attend through block tables.

One forward pass serves a mixed batch: some requests bring many prompt tokens, others one decode
token. The runner flattens all their tokens into one sequence of `num_tokens` rows, decodes
first, and describes the layout once per step in `AttentionMetadata`; every layer reuses it.

The reference backend below is plain PyTorch and runs on CPU and CUDA:
- decode tokens (one query per request) attend in one padded, batched pass over the gathered
  contexts (`decode_group_attention`);
- prompt tokens attend request by request with `F.scaled_dot_product_attention` (CPU's flash
  kernel), causal within the new tokens and over all of a cached prefix (`prompt_attention`).
A faster backend (Triton, FlashAttention) can replace `reference_paged_attention` behind the
same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto requests and KV slots.

    B = number of requests in the step, T = total tokens, K = longest context (in whole blocks).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64: each request's blocks (padded with 0)
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new tokens)
    query_lens_list: list[int]  # [B]: tokens each request runs now
    seq_lens_list: list[int]  # [B]: the same as seq_lens, as Python ints
    is_decode_only: bool  # every request runs exactly one token
    # Decode groups: [B, 1, 1, K] bool, True where a key is inside the request's context, and
    # [B, K] int64, the KV slot of each key position (block_id * block_size + offset).
    decode_mask: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    # Prompt groups: per request, [Q_i, K_i] bool (True: the query sees the key), or None
    # when the request has no cached prefix (Q_i == K_i: plain causal attention).
    prompt_masks: list[torch.Tensor | None] | None = None
    # A mixed step (decodes first, then prompt chunks) attends in two parts: (decode, prompt).
    parts: tuple[AttentionMetadata, AttentionMetadata] | None = None
    num_decode_tokens: int = 0


def reference_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's [T, Hkv, D] K and V
) -> torch.Tensor:  # [T, H, D]
    """Attend every query token over its request's context in the pool.

    `new_kv` (already written to the pool) lets a prompt with no cached prefix, whose context
    is exactly its own new tokens, attend over them without gathering them back.
    """
    if meta.parts is not None:
        decode, prompt = meta.parts
        n = meta.num_decode_tokens
        prompt_kv = None if new_kv is None else (new_kv[0][n:], new_kv[1][n:])
        return torch.cat([
            reference_paged_attention(query[:n], k_cache, v_cache, decode, scale),
            reference_paged_attention(query[n:], k_cache, v_cache, prompt, scale, prompt_kv),
        ])  # fmt: skip
    if meta.is_decode_only:
        return decode_group_attention(query, k_cache, v_cache, meta, scale)
    return prompt_attention(query, k_cache, v_cache, meta, scale, new_kv)


def decode_group_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Gather every request's context, padded to the longest, and attend in one batched pass.

    The gather reads K/V rows straight into a head-major [B, Hkv, K, D] layout, so both products
    are plain batched matmuls over (request, KV head): no broadcast copies of the context (which
    cost ~6x more at 8 requests of the 0.6B shape).
    """
    num_requests, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    kv_heads = torch.arange(num_kv_heads, device=query.device)
    # Row of each (request, KV head, key) in the cache viewed as [num_slots * Hkv, D].
    rows = meta.decode_slots[:, None, :] * num_kv_heads + kv_heads[None, :, None]  # [B, Hkv, K]
    k = k_cache.view(-1, head_dim)[rows]  # [B, Hkv, K, D]
    v = v_cache.view(-1, head_dim)[rows]  # [B, Hkv, K, D]
    # [B, H, D] -> [B, Hkv, group, D]: query heads grouped under the KV head they share.
    q = query.view(num_requests, num_kv_heads, group, head_dim)

    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, group, K]
    scores = scores.masked_fill(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, Hkv, group, D]
    return out.reshape(num_requests, num_heads, head_dim)


def prompt_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's [T, Hkv, D] K and V
) -> torch.Tensor:  # [T, H, D]
    """Request by request: gather the context (cached prefix + new tokens), then one SDPA call.

    Without padding, a prompt chunk costs what its own queries and context cost, whatever else
    runs in the step; CPU's flash kernel takes the mask and grouped heads as they are. A prompt
    without a cached prefix attends over `new_kv` directly when given (no gather).
    """
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
            k = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:num_keys]  # [K_i, Hkv, D]
            v = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:num_keys]
        q = query[start : start + num_queries]  # [Q_i, H, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, H, Q_i, D]
            k.transpose(0, 1)[None],  # [1, Hkv, K_i, D]
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, Q_i, D]
        outputs.append(out[0].transpose(0, 1))  # [Q_i, H, D]
        start += num_queries
    return torch.cat(outputs)


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
        if torch.compiler.is_compiling():
            # Only decode-only steps are compiled (ModelRunner.execute). The cache write is an
            # opaque in-place op (traced, index_copy_ would copy the whole cache); the
            # attention itself is traced, so inductor fuses it.
            assert meta.is_decode_only, "only decode-only steps run compiled"
            torch.ops.nanoserve.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return decode_attention(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale
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
    return reference_paged_attention(q, k_cache, v_cache, meta, scale, new_kv=(k, v))


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
    max_blocks = max(len(t) for t in block_tables)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    table = torch.zeros(num_requests, max_blocks, dtype=torch.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    is_decode_only = max(query_lens) == 1

    decode_mask = decode_slots = prompt_masks = None
    if is_decode_only:
        key_positions = torch.arange(max_blocks * block_size)  # [K]
        decode_mask = (key_positions[None, :] < seq_lens_t[:, None])[:, None, None].to(device)
        offsets = torch.arange(block_size)
        decode_slots = (table[:, :, None] * block_size + offsets).view(num_requests, -1).to(device)
    else:
        # A query at position p (within its sequence) sees keys at positions <= p.
        prompt_masks = []
        for num_queries, num_keys in zip(query_lens, seq_lens, strict=True):
            if num_queries == num_keys:
                prompt_masks.append(None)  # no cached prefix: plain causal
                continue
            query_positions = torch.arange(num_keys - num_queries, num_keys, device=device)
            key_positions = torch.arange(num_keys, device=device)
            prompt_masks.append(key_positions[None, :] <= query_positions[:, None])  # [Q, K]

    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device),
        block_tables=table.to(device),
        seq_lens=seq_lens_t.to(device),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        is_decode_only=is_decode_only,
        decode_mask=decode_mask,
        decode_slots=decode_slots,
        prompt_masks=prompt_masks,
    )
