"""A tied embedding read from its LM head's GEMV copy, so that a tied matrix is kept twice, not
three times.

With tied word embeddings (Qwen3-0.6B to 4B, Llama 3.2) the LM head and the embedding share one
[vocab, hidden] matrix. The CPU linear method packs the head for oneDNN and keeps a second copy
in the GEMV's layout (`linear.py`); the embedding kept the plain one alive, a third copy (a
quarter of the 0.6B model's weights). `GemvRowsEmbedding` gathers token `i`'s row from the
GEMV's copy instead (the same values, bit for bit) and the plain copy is dropped:

- in blocks of 64 rows ([vocab/64, hidden/2, 64, 2], `csrc/block_gemv.cpp`), token `i`'s row is
  block `i // 64`'s column `i % 64`;
- in AMX's tiles ([vocab/16, hidden/32, 16, 16, 2], `csrc/amx_gemv.cpp`), it is block
  `i // 16`'s column `i % 16` of every tile.

A lookup touches a row's pairs scattered over its block instead of one line after another:
microseconds for a decode step's tokens, about a millisecond for a 1,500-token prompt.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nanoserve.core.layers.linear import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger("nanoserve.cpu_linear")

BLOCK_ROWS = 64  # rows of the vocabulary per block of the block GEMV's layout
TILE_ROWS, TILE_K = 16, 32  # rows of the vocabulary per tile of AMX's layout, and its k


def layout_shape(vocab: int, hidden: int, dims: int) -> tuple[int, ...] | None:
    """The shape of a [vocab, hidden] matrix in the GEMV layout of `dims` dimensions (4: blocks,
    5: tiles), or None for another number."""
    if dims == 4:
        return (vocab // BLOCK_ROWS, hidden // 2, BLOCK_ROWS, 2)
    if dims == 5:
        return (vocab // TILE_ROWS, hidden // TILE_K, TILE_K // 2, TILE_ROWS, 2)
    return None


class GemvRowsEmbedding(nn.Module):
    """Token embeddings gathered from a [vocab, hidden] matrix in one of the GEMV's layouts
    (`layout`: blocks of 64 rows or AMX's tiles, held by the LM head, not copied).

    Both layouts keep each row's (k, k + 1) pairs whole: seen as 32-bit words and with the
    row-within-block dimension moved next to the block (a view), a token's row is one index
    pair, [i // rows, i % rows], whose words come out in k order."""

    def __init__(self, layout: torch.Tensor) -> None:
        super().__init__()
        self.layout = layout
        self.rows_per_block = BLOCK_ROWS if layout.dim() == 4 else TILE_ROWS
        words = layout.view(torch.int32).squeeze(-1)  # the pairs as words
        if layout.dim() == 4:  # [vocab/64, hidden/2, 64] -> [vocab/64, 64, hidden/2]
            self.words_by_row = words.permute(0, 2, 1)
        else:  # [vocab/16, hidden/32, 16, 16] -> [vocab/16, 16, hidden/32, 16]
            self.words_by_row = words.permute(0, 3, 1, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        block, row = input_ids // self.rows_per_block, input_ids % self.rows_per_block
        words = self.words_by_row[block, row]  # [T, hidden/2 words, in k order]
        return words.reshape(input_ids.shape[0], -1).view(self.layout.dtype)


def tied_gemv_layout(embedding: object, head: object) -> torch.Tensor | None:
    """The head's GEMV copy in blocks or tiles, if `embedding` is the one rank's tied embedding of
    it whose plain weight only the embedding still holds; else None."""
    if not isinstance(embedding, VocabParallelEmbedding) or not isinstance(head, ParallelLMHead):
        return None
    layout = getattr(head, "gemv_weight", None)
    weight = embedding.weight
    if embedding.tp.size > 1 or head.weight is not None or layout is None:
        return None  # sharded, or the plain weight kept (compiled decode), or no GEMV copy
    same_matrix = layout_shape(*weight.shape, layout.dim()) == layout.shape
    return layout if same_matrix and layout.dtype == weight.dtype else None


def read_tied_embedding_from_gemv_layout(model: nn.Module) -> bool:
    """Give a tied model's embedding `GemvRowsEmbedding` over its head's GEMV copy and drop the
    plain matrix, where that copy is in blocks or tiles. Returns whether it did."""
    inner = getattr(model, "model", None)
    embedding, head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    is_tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    layout = tied_gemv_layout(embedding, head) if is_tied else None
    if layout is None:
        return False
    assert inner is not None
    inner.embed_tokens = GemvRowsEmbedding(layout)
    logger.info("the tied embedding reads the LM head's GEMV copy (its plain copy dropped)")
    return True
