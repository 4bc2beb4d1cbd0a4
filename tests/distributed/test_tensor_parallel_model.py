"""The tensor-parallel model on CPU (gloo): N ranks, each holding its shard read from the
checkpoint, give the logits of one rank, for every architecture."""

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
from nanoserve.quantization.kv_cache_fp8 import Fp8KVAttention, KVScales

BLOCK_SIZE = 16
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def slot(table: list[int], position: int) -> int:
    return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def step_logits(
    checkpoint: str, tp: TensorParallel, fp8_kv: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Prefill both prompts in one batch, then one decode step; rank 0's logits of both (with
    `fp8_kv`, each rank's share of the KV cache in FP8, scales 0.5 and 0.25)."""
    model = load_model(EngineConfig(model=checkpoint, dtype="float32", device="cpu"), tp=tp).model
    attention = model.attention_layers()[0]
    shape = (8, BLOCK_SIZE, attention.num_kv_heads, attention.head_dim)
    num_layers, dtype = len(model.attention_layers()), torch.float32
    backend = ReferenceAttention()
    if fp8_kv:
        scales = {layer: {"k": 0.5, "v": 0.25} for layer in range(num_layers)}
        dtype = torch.float8_e4m3fn
        backend = Fp8KVAttention(backend, dtype, KVScales(num_layers, torch.device("cpu"), scales))
    for index, layer in enumerate(model.attention_layers()):
        caches = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        layer.bind(*caches, backend.for_layer(index))
    tables = [[0, 1], [2, 3]]
    lens = [len(p) for p in PROMPTS]
    slots = [slot(t, i) for t, n in zip(tables, lens, strict=True) for i in range(n)]
    meta = build_reference_metadata(lens, lens, tables, slots, BLOCK_SIZE, torch.device("cpu"))
    with torch.inference_mode():
        ids = torch.tensor([t for p in PROMPTS for t in p])
        positions = torch.tensor([i for n in lens for i in range(n)])
        prefill = model.compute_logits(model(ids, positions, meta))  # [T, vocab] on rank 0
        next_ids = torch.tensor([3, 9])
        decode_slots = [slot(t, n) for t, n in zip(tables, lens, strict=True)]
        meta = build_reference_metadata(
            [1, 1], [n + 1 for n in lens], tables, decode_slots, BLOCK_SIZE, torch.device("cpu")
        )
        decode = model.compute_logits(model(next_ids, torch.tensor(lens), meta))  # [2, vocab]
    return (prefill, decode) if tp.is_first else None


def _rank_main(
    rank: int, size: int, checkpoint: str, rendezvous: str, out: str, fp8_kv: bool
) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, rendezvous, torch.device("cpu"))
    result = step_logits(checkpoint, tp, fp8_kv)
    if result is not None:
        torch.save(result, out)
    torch.distributed.destroy_process_group()


def parallel_logits(checkpoint: Path, size: int, tmp_path: Path, fp8_kv: bool = False):
    out = tmp_path / f"logits-{size}.pt"
    rendezvous = f"file://{tmp_path / f'rendezvous-{size}'}"
    mp.spawn(_rank_main, args=(size, str(checkpoint), rendezvous, str(out), fp8_kv), nprocs=size)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("architecture", "size"),
    [("qwen3", 2), ("qwen2", 2), ("llama", 2), ("mistral", 2), ("qwen3", 4)],
)
def test_tensor_parallel_logits_equal_one_rank(tmp_path, architecture, size):
    """4 ranks on the tiny model (2 KV heads) replicate each KV head on two ranks."""
    checkpoint = make_tiny_checkpoint(tmp_path / "model", architecture)
    expected = step_logits(str(checkpoint), TensorParallel())
    got = parallel_logits(checkpoint, size, tmp_path)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.slow
def test_tensor_parallel_with_an_fp8_kv_cache_equals_one_rank(tmp_path):
    """Each rank quantizes and reads its own KV heads: the logits are one rank's with FP8."""
    checkpoint = make_tiny_checkpoint(tmp_path / "model", "qwen3")
    expected = step_logits(str(checkpoint), TensorParallel(), fp8_kv=True)
    unquantized = step_logits(str(checkpoint), TensorParallel())
    got = parallel_logits(checkpoint, 2, tmp_path, fp8_kv=True)
    for ours, theirs, plain in zip(got, expected, unquantized, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        assert not torch.allclose(theirs, plain, atol=1e-4)  # FP8 made a difference


def test_sizes_that_do_not_divide_the_model_are_named():
    from nanoserve.core.models.llama import local_kv_heads

    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by .* \(3\)"):
        TensorParallel(rank=0, size=3).split(4, "num_attention_heads")
    assert local_kv_heads(2, TensorParallel(rank=3, size=4)) == (1, 1)  # rank 3 shares head 1
    assert local_kv_heads(8, TensorParallel(rank=1, size=2)) == (4, 4)
    with pytest.raises(ValueError, match="must be a multiple of num_key_value_heads"):
        local_kv_heads(3, TensorParallel(rank=0, size=4))
