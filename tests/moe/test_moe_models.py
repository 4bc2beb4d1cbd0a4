"""Qwen3-MoE and Mixtral against transformers: the same fp32 logits for batched prefills and
decode steps, the checkpoint's per-expert tensors stacked into place, and the expert load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import MOE_ARCHITECTURES, make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve.common.config import EngineConfig
from nanoserve.core.attention.reference import ReferenceAttention, build_reference_metadata
from nanoserve.core.loader import LoadedModel, load_model
from nanoserve.core.models.llama import LlamaMLP
from nanoserve.moe.layer import SparseMoeBlock
from nanoserve.moe.models import expert_load_summary, moe_model_classes

BLOCK_SIZE = 16
TOLERANCE = 1e-4  # max abs logit difference in float32


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def ours(checkpoint) -> LoadedModel:
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32")
    return load_model(config, model_classes=moe_model_classes())


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 320, (length,), generator=generator).tolist()


def run_batch(loaded: LoadedModel, prompts: list[list[int]], num_decodes: int) -> list:
    """Prefill every prompt in one batch, then `num_decodes` batched decode steps feeding
    each sequence the next token of its own prompt-continuation; every step's logits."""
    model, config = loaded.model, loaded.model_config
    blocks_per_seq = 8
    shape = (
        1 + len(prompts) * blocks_per_seq,
        BLOCK_SIZE,
        config.num_key_value_heads,
        config.head_dim,
    )
    for layer in model.attention_layers():
        dtype = next(model.parameters()).dtype
        layer.bind(
            torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), ReferenceAttention()
        )
    tables = [
        list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        for i in range(len(prompts))
    ]
    steps = [[len(p) - num_decodes for p in prompts]] + [[1] * len(prompts)] * num_decodes
    done = [0] * len(prompts)
    outputs = []
    for lengths in steps:
        ids, positions, slots, seq_lens, step_tables = [], [], [], [], []
        for seq, n in enumerate(lengths):
            span = range(done[seq], done[seq] + n)
            ids += prompts[seq][span.start : span.stop]
            positions += span
            slots += [tables[seq][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
            done[seq] += n
            seq_lens.append(done[seq])
            step_tables.append(tables[seq][: math.ceil(done[seq] / BLOCK_SIZE)])
        meta = build_reference_metadata(lengths, seq_lens, step_tables, slots, BLOCK_SIZE, "cpu")
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions), meta)
            outputs.append(model.compute_logits(hidden).split(lengths))
    return outputs


def test_batched_prefill_and_decode_match_transformers(ours, reference):
    prompts = [random_prompt(n, seed=n) for n in (4, 9, 33, 70)]
    steps = run_batch(ours, prompts, num_decodes=3)
    for seq, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()  # [L, vocab]
        got = torch.cat([step[seq] for step in steps])  # the prefill's rows, then each decode's
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= TOLERANCE


def test_sparse_and_dense_layers_follow_the_config(ours):
    moe = ours.model_config.moe
    assert moe is not None
    mlps = [layer.mlp for layer in ours.model.model.layers]
    if ours.model_config.architecture == "Qwen3MoeForCausalLM":
        assert [type(m) for m in mlps] == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]  # [1] dense
        assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 3, True)
    else:
        assert [type(m) for m in mlps] == [SparseMoeBlock, SparseMoeBlock]
        assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (4, 2, True)


def test_experts_are_stacked_from_the_checkpoint_tensors(ours, reference):
    """Expert e's gate and up rows are w13[e]'s two halves, its down projection w2[e]."""
    ref_layer = reference.model.layers[0].mlp
    block = ours.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    torch.testing.assert_close(block.gate, ref_layer.gate.weight, rtol=0, atol=0)
    torch.testing.assert_close(block.w13, ref_layer.experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(block.w2, ref_layer.experts.down_proj, rtol=0, atol=0)


def test_expert_load_counts_every_choice_in_a_fixed_table(ours):
    before = ours.model.expert_load()
    prompts = [random_prompt(12, seed=7)]
    run_batch(ours, prompts, num_decodes=0)
    after = ours.model.expert_load()
    moe = ours.model_config.moe
    num_sparse = sum(moe.is_sparse(i) for i in range(ours.model_config.num_hidden_layers))
    assert after.shape == (num_sparse, moe.num_experts)
    assert ((after - before).sum(dim=1) == 12 * moe.num_experts_per_tok).all()
    assert "layer 0:" in expert_load_summary(after)


def test_expert_load_is_logged_at_most_once_per_interval(ours, caplog, monkeypatch):
    from nanoserve.moe.models import ExpertLoadLog

    ours.model.load_log = ExpertLoadLog(interval_s=3600.0)
    ours.model.load_log.last_s -= 3601.0  # an interval has passed
    with caplog.at_level("INFO", logger="nanoserve.moe"):
        run_batch(ours, [random_prompt(5, seed=1)], num_decodes=2)  # three forward passes
    lines = [r.getMessage() for r in caplog.records if "expert load" in r.getMessage()]
    assert len(lines) == 1 and "layer 0:" in lines[0]
