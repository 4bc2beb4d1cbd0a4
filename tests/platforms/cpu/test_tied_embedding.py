"""A tied embedding read from its LM head's GEMV copy in blocks or AMX's tiles
(tied_embedding.py): the same rows as the plain matrix, bit for bit, and one copy of the matrix
fewer in an engine."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.common.cpu_features import has_amx_bf16
from nanoserve.core.layers.linear import ParallelLMHead, VocabParallelEmbedding
from nanoserve.core.parallel import TensorParallel
from nanoserve.platforms.cpu import fast_paths
from nanoserve.platforms.cpu.tied_embedding import GemvRowsEmbedding, tied_gemv_layout

needs_amx = pytest.mark.skipif(not has_amx_bf16(), reason="this CPU has no AMX (bf16 tiles)")


def layouts(kernels, weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` in the GEMV's layouts this CPU has: blocks of 64 rows, AMX's tiles."""
    laid_out = [kernels.bf16_blocks(weight)]
    if has_amx_bf16():
        laid_out.append(kernels.amx_gemv_layout(weight))
    return laid_out


def test_rows_gathered_from_the_gemv_layouts_are_the_plain_rows_bit_for_bit(kernels):
    weight = torch.randn(256, 64, dtype=torch.bfloat16)
    for layout in layouts(kernels, weight):
        embedding = GemvRowsEmbedding(layout)
        ids = torch.tensor([0, 15, 16, 63, 64, 65, 127, 128, 255, 7, 7, 200])  # edges, a repeat
        assert torch.equal(embedding(ids), F.embedding(ids, weight))
        many = torch.randint(0, 256, (1000,))
        assert torch.equal(embedding(many), F.embedding(many, weight))
        assert embedding(many).is_contiguous()
        with pytest.raises(IndexError):
            embedding(torch.tensor([256]))  # past the vocabulary, as F.embedding


def tied_pair(kernels, head_keeps_weight: bool = False, tp_size: int = 1, tiles: bool = False):
    embedding = VocabParallelEmbedding(128, 32, TensorParallel())
    embedding.weight.data = torch.randn(128, 32).bfloat16()
    embedding.tp = TensorParallel(size=tp_size)  # the rank's place; no group is needed here
    head = ParallelLMHead(32, 128, TensorParallel())
    lay_out = kernels.amx_gemv_layout if tiles else kernels.bf16_blocks
    head.gemv_weight = lay_out(embedding.weight.detach())
    if not head_keeps_weight:
        head.weight = None
    return embedding, head


@pytest.mark.parametrize("tiles", [False, pytest.param(True, marks=needs_amx)])
def test_only_a_one_rank_tied_embedding_whose_head_dropped_its_plain_weight_reads_its_layout(
    kernels, tiles
):
    embedding, head = tied_pair(kernels, tiles=tiles)
    assert tied_gemv_layout(embedding, head) is head.gemv_weight  # the head's copy itself
    assert tied_gemv_layout(*tied_pair(kernels, head_keeps_weight=True, tiles=tiles)) is None
    assert tied_gemv_layout(*tied_pair(kernels, tp_size=2, tiles=tiles)) is None  # a shard
    head.gemv_weight = embedding.weight.detach()  # the GEMV reads the plain weight
    assert tied_gemv_layout(embedding, head) is None
    head.gemv_weight = kernels.bf16_blocks(torch.randn(64, 32).bfloat16())  # another matrix
    assert tied_gemv_layout(embedding, head) is None


def test_a_tied_engine_keeps_two_copies_of_the_matrix_and_generates_the_same_tokens(
    tmp_path, monkeypatch
):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")  # tied embeddings
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (3, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)

    llm = LLM(checkpoint, dtype="bfloat16")
    model = llm.engine.model
    layout = getattr(model.lm_head, "gemv_weight", None)
    if layout is not None and layout.dim() in (4, 5):  # the GEMV's copy in blocks or tiles here
        assert isinstance(model.model.embed_tokens, GemvRowsEmbedding)
        assert model.model.embed_tokens.layout is layout
        vocab_by_hidden = (model.config.vocab_size, model.config.hidden_size)
        assert all(p.shape != vocab_by_hidden for p in model.parameters())  # no plain copy
    else:  # no GEMV copy (the GEMV not faster here), or a plain one: the plain matrix stays
        assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
        assert model.model.embed_tokens.weight is not None
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setattr(fast_paths, "read_tied_embedding_from_gemv_layout", lambda model: False)
    plain = LLM(checkpoint, dtype="bfloat16")
    assert isinstance(plain.engine.model.model.embed_tokens, VocabParallelEmbedding)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == tokens
