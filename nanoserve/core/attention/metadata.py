"""AttentionMetadata: what every attention backend knows about one step's flat token batch.

One forward pass serves a mixed batch: some requests bring many prompt tokens, others one decode
token. The runner flattens all their tokens into one sequence (`StepLayout`, decodes first); the
engine's backend builds its metadata from it once per step, and every layer reuses it. These are
the fields every backend shares; one that needs more (the reference's masks) extends them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TypeVar

import torch

M = TypeVar("M", bound="AttentionMetadata")


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto requests and KV slots.

    B = number of requests in the step, T = total tokens."""

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64: each request's blocks (padded with 0)
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] int64: where each request's tokens start in the batch
    query_lens_list: list[int]  # [B]: tokens each request runs now
    seq_lens_list: list[int]  # [B]: the same as seq_lens, as Python ints
    is_decode_only: bool  # every request runs exactly one token

    @classmethod
    def build(
        cls: type[M],
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str,
    ) -> M:
        """The shared fields of one step, as device tensors (built once on the host)."""
        width = max(map(len, block_tables))  # rows padded, then one tensor (not one per row)
        table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int64)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device),
            block_tables=table.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
            query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)]).to(device),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            is_decode_only=max(query_lens) == 1,
        )
