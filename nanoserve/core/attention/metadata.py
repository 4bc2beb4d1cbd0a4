"""AttentionMetadata: how the flat token batch of one step maps onto requests and KV slots.

One forward pass serves a mixed batch: some requests bring many prompt tokens, others one decode
token. The runner flattens all their tokens into one sequence of `num_tokens` rows, decodes
first, and describes the layout once per step here; every layer and every backend reuses it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto requests and KV slots.

    B = number of requests in the step, T = total tokens, K = longest context (in whole blocks).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64: each request's blocks (padded with 0)
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] int64: where each request's tokens start in the batch
    query_lens_list: list[int]  # [B]: tokens each request runs now
    seq_lens_list: list[int]  # [B]: the same as seq_lens, as Python ints
    is_decode_only: bool  # every request runs exactly one token
    # The rest is what the eager backend reads (built only for it).
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


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device,
    eager_fields: bool = True,
) -> AttentionMetadata:
    """Build the per-step layout once on the CPU side; every layer reads it.

    With `eager_fields` (the eager backend) it also holds the masks and gather indices that
    backend attends with, and, when one-token (decode) requests come first and prompt chunks
    follow, two parts that attend separately (see `AttentionMetadata.parts`).
    """
    meta = _build_group(
        query_lens, seq_lens, block_tables, slot_mapping, block_size, device, eager_fields
    )
    if not eager_fields:
        return meta
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
    eager_fields: bool = True,
) -> AttentionMetadata:
    num_requests = len(query_lens)
    max_blocks = max(len(t) for t in block_tables)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    table = torch.zeros(num_requests, max_blocks, dtype=torch.int64)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    is_decode_only = max(query_lens) == 1

    decode_mask: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    prompt_masks: list[torch.Tensor | None] | None = None
    if eager_fields and is_decode_only:
        key_positions = torch.arange(max_blocks * block_size)  # [K]
        decode_mask = (key_positions[None, :] < seq_lens_t[:, None])[:, None, None].to(device)
        offsets = torch.arange(block_size)
        decode_slots = (table[:, :, None] * block_size + offsets).view(num_requests, -1).to(device)
    elif eager_fields:
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
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)]).to(device),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        is_decode_only=is_decode_only,
        decode_mask=decode_mask,
        decode_slots=decode_slots,
        prompt_masks=prompt_masks,
    )
