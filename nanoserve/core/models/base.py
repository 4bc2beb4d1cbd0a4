"""What the engine needs of any model."""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.core.attention.layer import PagedAttention


class CausalLM(nn.Module):
    """A causal LM over the paged KV cache, as the engine sees it: `forward(input_ids [T],
    positions [T], attn_meta, output_rows [S] or None)` gives the hidden states of every row
    (or of `output_rows`), `compute_logits` the logits of the rows that sample, and
    `attention_layers` the layers the KV cache is bound to."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        raise NotImplementedError

    def attention_layers(self) -> list[PagedAttention]:
        raise NotImplementedError
