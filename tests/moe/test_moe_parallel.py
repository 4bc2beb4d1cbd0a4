"""MoE models split across 2 ranks on CPU (gloo): tensor parallelism (a slice of every expert
per rank) and expert parallelism (whole experts per rank) give one rank's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.core.attention.reference import ReferenceAttention, build_reference_metadata
from nanoserve.core.loader import load_model
from nanoserve.core.parallel import TensorParallel
from nanoserve.distributed.parallel import init_tensor_parallel
from nanoserve.moe.models import moe_model_classes

BLOCK_SIZE = 16
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def slot(table: list[int], position: int) -> int:
    return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def step_logits(checkpoint: str, tp: TensorParallel, expert_parallel: bool):
    """Prefill both prompts in one batch, then one decode step; rank 0's logits of both, and
    the number of experts this rank holds per sparse layer."""
    config = EngineConfig(model=checkpoint, dtype="float32", device="cpu")
    model = load_model(config, tp=tp, model_classes=moe_model_classes(expert_parallel)).model
    attention = model.attention_layers()[0]
    shape = (8, BLOCK_SIZE, attention.num_kv_heads, attention.head_dim)
    for layer in model.attention_layers():
        layer.bind(torch.zeros(shape), torch.zeros(shape), ReferenceAttention())
    tables = [[0, 1], [2, 3]]
    lens = [len(p) for p in PROMPTS]
    slots = [slot(t, i) for t, n in zip(tables, lens, strict=True) for i in range(n)]
    meta = build_reference_metadata(lens, lens, tables, slots, BLOCK_SIZE, torch.device("cpu"))
    with torch.inference_mode():
        ids = torch.tensor([t for p in PROMPTS for t in p])
        positions = torch.tensor([i for n in lens for i in range(n)])
        prefill = model.compute_logits(model(ids, positions, meta))
        decode_slots = [slot(t, n) for t, n in zip(tables, lens, strict=True)]
        meta = build_reference_metadata(
            [1, 1], [n + 1 for n in lens], tables, decode_slots, BLOCK_SIZE, torch.device("cpu")
        )
        decode = model.compute_logits(model(torch.tensor([3, 9]), torch.tensor(lens), meta))
    local_experts = model.moe_blocks()[0].w13.shape[0]
    return prefill, decode, local_experts


def _rank_main(rank, size, checkpoint, expert_parallel, rendezvous, out) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, rendezvous, torch.device("cpu"))
    prefill, decode, local_experts = step_logits(checkpoint, tp, expert_parallel)
    torch.save((prefill, decode, local_experts), f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_give_one_ranks_logits(tmp_path: Path, architecture, expert_parallel):
    checkpoint = make_tiny_checkpoint(tmp_path / "model", architecture)
    one_prefill, one_decode, num_experts = step_logits(str(checkpoint), TensorParallel(), False)
    out = tmp_path / "logits"
    args = (2, str(checkpoint), expert_parallel, f"file://{tmp_path / 'rendezvous'}", str(out))
    mp.spawn(_rank_main, args=args, nprocs=2)
    prefill, decode, local_experts = torch.load(f"{out}.0")
    for ours, theirs in ((prefill, one_prefill), (decode, one_decode)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # Expert parallelism: half of the experts each; tensor parallelism: a slice of all of them.
    assert local_experts == (num_experts // 2 if expert_parallel else num_experts)
    assert torch.load(f"{out}.1")[2] == local_experts
