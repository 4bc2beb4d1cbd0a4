"""A tied embedding read from its LM head's GEMV copy, so that a tied matrix is kept twice, not
three times.

With tied word embeddings (Qwen3-0.6B to 4B, Llama 3.2) the LM head and the embedding share one
[vocab, hidden] matrix. The CPU linear method packs the head for oneDNN and keeps a second copy
in the GEMV's layout (`linear.py`); the embedding kept the plain one alive, a third copy (a
quarter of the 0.6B model's weights). Where the GEMV's copy is in blocks of 64 rows
([vocab/64, hidden/2, 64, 2], `csrc/block_gemv.cpp`), token `i`'s row is block `i // 64`'s
column `i % 64`: `BlockRowsEmbedding` gathers it from there (the same values, bit for bit) and
the plain copy is dropped. A lookup touches a row's pairs 256 bytes apart instead of one line
after another: microseconds for a decode step's tokens.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nanoserve.core.layers.linear import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger("nanoserve.cpu_linear")

BLOCK_ROWS = 64  # rows of the vocabulary per block of the GEMV's layout


class BlockRowsEmbedding(nn.Module):
    """Token embeddings gathered from a [vocab, hidden] matrix laid out in blocks of 64 rows
    (`blocks` [vocab/64, hidden/2, 64, 2], held by the LM head, not copied)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        rows = self.blocks[input_ids // BLOCK_ROWS, :, input_ids % BLOCK_ROWS]  # [T, hidden/2, 2]
        return rows.reshape(input_ids.shape[0], -1)


def tied_blocks(embedding: object, head: object) -> torch.Tensor | None:
    """The head's GEMV copy in blocks, if `embedding` is the one rank's tied embedding of it whose
    plain weight only the embedding still holds; else None."""
    if not isinstance(embedding, VocabParallelEmbedding) or not isinstance(head, ParallelLMHead):
        return None
    blocks = getattr(head, "gemv_weight", None)
    weight = embedding.weight
    if embedding.tp.size > 1 or head.weight is not None or blocks is None or blocks.dim() != 4:
        return None  # sharded, the plain weight kept (compiled decode), or no blocks
    vocab, hidden = weight.shape
    same_matrix = (vocab // BLOCK_ROWS, hidden // 2, BLOCK_ROWS, 2) == blocks.shape
    return blocks if same_matrix and blocks.dtype == weight.dtype else None


def read_tied_embedding_from_gemv_layout(model: nn.Module) -> bool:
    """Give a tied model's embedding `BlockRowsEmbedding` over its head's GEMV copy and drop
    the plain matrix, where that copy is in blocks. Returns whether it did."""
    inner = getattr(model, "model", None)
    embedding, head = getattr(inner, "embed_tokens", None), getattr(model, "lm_head", None)
    is_tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    blocks = tied_blocks(embedding, head) if is_tied else None
    if blocks is None:
        return False
    assert inner is not None
    inner.embed_tokens = BlockRowsEmbedding(blocks)
    logger.info("the tied embedding reads the LM head's GEMV copy (its plain copy dropped)")
    return True
