"""A block-scaled FP8 Qwen3-MoE checkpoint (Qwen3-30B-A3B-FP8's layout: every expert's
projections in FP8 with per-block scales, the router in the model dtype) loads into the model
its dequantized weights make: transformers on those weights is the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from test_moe_engine import greedy, run_to_completion
from tiny_checkpoints import make_fp8_checkpoint, make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve.common.config import EngineConfig
from nanoserve.engine_setup import build_engine
from nanoserve.quantization.fp8 import FP8, dequantize

BLOCK = (16, 16)


def dequantized_copy(fp8_dir: Path, target: Path) -> Path:
    shutil.copytree(fp8_dir, target, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(fp8_dir / "model.safetensors")
    plain = {
        name: dequantize(t, tensors[f"{name}_scale_inv"], BLOCK) if t.dtype == FP8 else t
        for name, t in tensors.items()
        if not name.endswith("_scale_inv")
    }
    save_file(plain, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_fp8_experts_load_dequantized_and_generate_as_transformers(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "source", "qwen3_moe")
    fp8_dir = make_fp8_checkpoint(source, tmp_path / "fp8", block_size=BLOCK)
    tensors = load_file(fp8_dir / "model.safetensors")
    assert tensors["model.layers.0.mlp.experts.5.down_proj.weight"].dtype == FP8
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router
    plain_dir = dequantized_copy(fp8_dir, tmp_path / "plain")
    reference = AutoModelForCausalLM.from_pretrained(plain_dir, dtype=torch.float32)
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3]]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = reference.generate(ids, do_sample=False, max_new_tokens=8, min_new_tokens=8)
        expected.append(out[0, len(prompt) :].tolist())
    config = EngineConfig(model=str(fp8_dir), dtype="float32", device="cpu", max_model_len=64)
    engine = build_engine(config)
    assert run_to_completion(engine, prompts, greedy(8)) == expected
    block = engine.model.moe_blocks()[0]
    torch.testing.assert_close(
        block.w2[5],
        tensors_of(plain_dir)["model.layers.0.mlp.experts.5.down_proj.weight"],
        rtol=0,
        atol=0,
    )


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")
