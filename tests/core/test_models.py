"""The Llama-family model against transformers: the same fp32 logits, batched and step by step."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import ARCHITECTURES, make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve.common.config import EngineConfig
from nanoserve.core.attention.reference import (
    ReferenceAttention,
    build_reference_metadata,
    paged_attention,
)
from nanoserve.core.loader import LoadedModel, load_model

BLOCK_SIZE = 16
TOLERANCE = 1e-4  # max abs logit difference in float32


class PagedBatchRunner:
    """A minimal model runner: each sequence owns consecutive KV blocks; one batch per step."""

    def __init__(self, loaded: LoadedModel, num_seqs: int, max_seq_len: int = 128) -> None:
        self.model = loaded.model
        config = loaded.model_config
        blocks_per_seq = math.ceil(max_seq_len / BLOCK_SIZE)
        num_blocks = 1 + num_seqs * blocks_per_seq  # block 0 stays unused, as padding does
        kv_shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        for layer in self.model.attention_layers():
            layer.bind(torch.zeros(kv_shape), torch.zeros(kv_shape), ReferenceAttention())
        self.block_tables = [
            list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
            for i in range(num_seqs)
        ]
        self.num_computed = [0] * num_seqs

    def step(
        self, chunks: dict[int, list[int]], output_rows: list[int] | None = None
    ) -> torch.Tensor:
        """Run each sequence's next tokens in one batch; logits for every token [T, vocab],
        or only for `output_rows` [S, vocab]."""
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.num_computed[seq]
            seq_len = start + len(tokens)
            table = self.block_tables[seq]
            input_ids += tokens
            positions += range(start, seq_len)
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, seq_len)
            ]
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            tables.append(table[: math.ceil(seq_len / BLOCK_SIZE)])
            self.num_computed[seq] = seq_len
        meta = build_reference_metadata(
            query_lens, seq_lens, tables, slots, BLOCK_SIZE, torch.device("cpu")
        )
        with torch.no_grad():
            rows = None if output_rows is None else torch.tensor(output_rows, dtype=torch.int64)
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), meta, rows)
            return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def ours(checkpoint) -> LoadedModel:
    return load_model(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:  # [L, vocab]
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].float()


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 320, (length,), generator=generator).tolist()


def test_batched_prefill_matches_transformers(ours, reference):
    # 100 tokens: past the tiny Llama's original_max_position_embeddings (64) for llama3 RoPE.
    prompts = [random_prompt(n, seed=n) for n in (1, 7, 33, 100)]
    runner = PagedBatchRunner(ours, num_seqs=len(prompts))
    logits = runner.step(dict(enumerate(prompts)))
    assert logits.shape == (sum(map(len, prompts)), 320)
    assert logits.dtype == torch.float32
    for prompt, got in zip(prompts, logits.split([len(p) for p in prompts]), strict=True):
        expected = reference_logits(reference, prompt)
        assert (got - expected).abs().max().item() <= TOLERANCE


def test_chunked_prefill_and_decode_match_transformers(ours, reference):
    seq_a, seq_b = random_prompt(72, seed=1), random_prompt(19, seed=2)
    expected = [reference_logits(reference, seq_a), reference_logits(reference, seq_b)]
    runner = PagedBatchRunner(ours, num_seqs=2)
    # Prefill chunks, then a mixed step (decode A while B runs a chunk), then decode both;
    # A decodes at positions past the tiny Llama's original_max_position_embeddings (64).
    schedule = [{0: 60, 1: 3}, {0: 1, 1: 5}] + [{0: 1, 1: 1}] * 11
    for step in schedule:
        chunks = {}
        for seq, num_tokens in step.items():
            start = runner.num_computed[seq]
            chunks[seq] = (seq_a, seq_b)[seq][start : start + num_tokens]
        starts = {seq: runner.num_computed[seq] for seq in chunks}
        logits = runner.step(chunks)
        for (seq, tokens), got in zip(
            chunks.items(), logits.split([len(t) for t in chunks.values()]), strict=True
        ):
            want = expected[seq][starts[seq] : starts[seq] + len(tokens)]
            assert (got - want).abs().max().item() <= TOLERANCE, (seq, starts[seq])
    assert runner.num_computed == [72, 19]


def test_output_rows_finish_only_those_rows_and_still_cache_every_token(ours, reference):
    """The runner asks for the rows it samples; the others' keys and values still reach the
    cache, so the steps after match transformers."""
    seq_a, seq_b = random_prompt(40, seed=3), random_prompt(25, seed=4)
    expected = [reference_logits(reference, seq_a), reference_logits(reference, seq_b)]
    runner = PagedBatchRunner(ours, num_seqs=2)
    # A runs a first chunk (nothing to sample), B all but one token (sample its last row).
    logits = runner.step({0: seq_a[:30], 1: seq_b[:24]}, output_rows=[53])
    assert logits.shape == (1, 320)
    assert (logits[0] - expected[1][23]).abs().max().item() <= TOLERANCE
    # A chunk with no row to sample finishes no row at all.
    assert runner.step({0: seq_a[30:39]}, output_rows=[]).shape == (0, 320)
    logits = runner.step({0: seq_a[39:], 1: seq_b[24:]})  # every row
    assert (logits[0] - expected[0][39]).abs().max().item() <= TOLERANCE
    assert (logits[1] - expected[1][24]).abs().max().item() <= TOLERANCE


def test_attention_layers_in_layer_order(ours):
    layers = ours.model.attention_layers()
    assert len(layers) == ours.model_config.num_hidden_layers == 2
    for layer, block in zip(layers, ours.model.model.layers, strict=True):
        assert layer is block.self_attn.attn
        assert (layer.num_heads, layer.num_kv_heads) == (4, 2)


def test_lm_head_tied_only_when_config_says_so(ours):
    model = ours.model
    is_shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert is_shared == ours.model_config.tie_word_embeddings
    assert is_shared == (ours.model_config.architecture == "Qwen3ForCausalLM")


def test_mixed_step_attends_decodes_apart_from_prompt_chunks():
    """Decodes first, then prompt chunks: two attention parts, same result as one padded pass."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    k_cache = torch.randn(12, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(12, block_size, num_kv_heads, head_dim)
    query_lens, seq_lens = [1, 1, 6], [5, 3, 9]
    tables = [[0, 1], [2], [3, 4, 5]]
    slots = [4, 2 * 4 + 2] + [3 * 4 + 3, 4 * 4, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 5 * 4]
    query = torch.randn(sum(query_lens), num_heads, head_dim)
    split = build_reference_metadata(query_lens, seq_lens, tables, slots, block_size, "cpu")
    assert split.parts is not None and split.num_decode_tokens == 2
    whole = replace(split, parts=None)
    torch.testing.assert_close(
        paged_attention(query, k_cache, v_cache, split, 0.3),
        paged_attention(query, k_cache, v_cache, whole, 0.3),
    )
