"""Dummy benchmark checkpoints: each preset's shape and dtype, reused when already written."""

from __future__ import annotations

import json

from safetensors import safe_open

from nanoserve.bench.models import PRESETS, make_dummy_checkpoint


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
