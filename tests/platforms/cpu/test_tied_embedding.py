"""A tied embedding read from its LM head's GEMV copy in blocks (tied_embedding.py): the same
rows as the plain matrix, bit for bit, and one copy of the matrix fewer in an engine."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.core.layers.linear import ParallelLMHead, VocabParallelEmbedding
from nanoserve.core.parallel import TensorParallel
from nanoserve.platforms.cpu import fast_paths
from nanoserve.platforms.cpu.tied_embedding import BlockRowsEmbedding, tied_blocks


def test_rows_gathered_from_the_blocks_are_the_plain_rows_bit_for_bit(kernels):
    weight = torch.randn(256, 48, dtype=torch.bfloat16)
    embedding = BlockRowsEmbedding(kernels.bf16_blocks(weight))
    ids = torch.tensor([0, 63, 64, 65, 127, 128, 255, 7, 7, 200])  # block edges, a repeat
    assert torch.equal(embedding(ids), F.embedding(ids, weight))
    many = torch.randint(0, 256, (1000,))
    assert torch.equal(embedding(many), F.embedding(many, weight))
    assert embedding(many).is_contiguous()
    with pytest.raises(IndexError):
        embedding(torch.tensor([256]))  # past the vocabulary, as F.embedding


def tied_pair(kernels, head_keeps_weight: bool = False, tp_size: int = 1):
    embedding = VocabParallelEmbedding(128, 32, TensorParallel())
    embedding.weight.data = torch.randn(128, 32).bfloat16()
    embedding.tp = TensorParallel(size=tp_size)  # the rank's place; no group is needed here
    head = ParallelLMHead(32, 128, TensorParallel())
    head.gemv_weight = kernels.bf16_blocks(embedding.weight.detach())
    if not head_keeps_weight:
        head.weight = None
    return embedding, head


def test_only_a_one_rank_tied_embedding_whose_head_dropped_its_plain_weight_reads_blocks(kernels):
    embedding, head = tied_pair(kernels)
    assert tied_blocks(embedding, head) is head.gemv_weight  # the head's copy itself
    assert tied_blocks(*tied_pair(kernels, head_keeps_weight=True)) is None  # compiled decode
    assert tied_blocks(*tied_pair(kernels, tp_size=2)) is None  # a rank's shard
    head.gemv_weight = embedding.weight.detach()  # the GEMV reads the plain layout (AMX)
    assert tied_blocks(embedding, head) is None
    head.gemv_weight = kernels.bf16_blocks(torch.randn(64, 32).bfloat16())  # another matrix
    assert tied_blocks(embedding, head) is None


def test_a_tied_engine_keeps_two_copies_of_the_matrix_and_generates_the_same_tokens(
    tmp_path, monkeypatch
):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")  # tied embeddings
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in (3, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)

    llm = LLM(checkpoint, dtype="bfloat16")
    model = llm.engine.model
    blocks = getattr(model.lm_head, "gemv_weight", None)
    if blocks is not None and blocks.dim() == 4:  # the GEMV's copy is in blocks here
        assert isinstance(model.model.embed_tokens, BlockRowsEmbedding)
        assert model.model.embed_tokens.blocks is blocks
        vocab_by_hidden = (model.config.vocab_size, model.config.hidden_size)
        assert all(p.shape != vocab_by_hidden for p in model.parameters())  # no plain copy
    else:  # no blocks (AMX, or the GEMV not faster here): the plain matrix stays
        assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
        assert model.model.embed_tokens.weight is not None
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setattr(fast_paths, "read_tied_embedding_from_gemv_layout", lambda model: False)
    plain = LLM(checkpoint, dtype="bfloat16")
    assert isinstance(plain.engine.model.model.embed_tokens, VocabParallelEmbedding)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == tokens
