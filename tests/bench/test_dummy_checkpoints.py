"""Dummy benchmark checkpoints: each preset's shape and dtype, reused when already written;
the bytes a decode token reads from a checkpoint."""

from __future__ import annotations

import json

from safetensors import safe_open
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.bench.models import PRESETS, decode_weight_bytes, make_dummy_checkpoint


def tensor_dtypes(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {f.get_slice(key).get_dtype() for key in f.keys()}  # noqa: SIM118


def test_presets_write_their_shape_in_their_dtype(tmp_path):
    bf16 = make_dummy_checkpoint(tmp_path / "test", "test")
    assert tensor_dtypes(bf16) == {"BF16"}
    small = make_dummy_checkpoint(tmp_path / "small", "small-fp32")
    assert tensor_dtypes(small) == {"F32"}
    config = json.loads((small / "config.json").read_text())
    for key, value in PRESETS["small-fp32"].items():
        assert config[key] == value
    stamp = json.loads((small / "bench_model.json").read_text())
    assert stamp["dtype"] == "float32"
    written = (small / "model.safetensors").stat().st_mtime_ns
    make_dummy_checkpoint(small, "small-fp32")  # the same preset and seed: reused, not rewritten
    assert (small / "model.safetensors").stat().st_mtime_ns == written


def tensor_bytes(directory) -> dict[str, int]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key).nbytes for key in f.keys()}  # noqa: SIM118


def test_a_decode_token_reads_every_weight_but_the_embedding_and_only_its_experts(tmp_path):
    dense = make_dummy_checkpoint(tmp_path / "test", "test")  # tied: the embedding is the head
    assert decode_weight_bytes(dense) == sum(tensor_bytes(dense).values())
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    config = json.loads((moe / "config.json").read_text())
    num_experts = config.get("num_experts") or config["num_local_experts"]  # transformers 5
    share = config["num_experts_per_tok"] / num_experts
    sizes = tensor_bytes(moe)
    experts = sum(n for key, n in sizes.items() if ".experts." in key)
    embedding = sizes["model.embed_tokens.weight"] * (not config["tie_word_embeddings"])
    assert 0 < share < 1 and experts > 0
    expected = sum(sizes.values()) - embedding - experts + experts * share
    assert decode_weight_bytes(moe) == round(expected)
