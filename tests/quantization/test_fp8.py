"""Block-scaled FP8 checkpoints: the format round-trips, and a checkpoint written in it loads
into the same model as its dequantized weights (transformers is the oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import make_fp8_checkpoint, make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from nanoserve.common.checkpoint import ModelLoadError, load_model_config
from nanoserve.common.config import EngineConfig
from nanoserve.core.loader import load_model
from nanoserve.quantization import fp8
from nanoserve.quantization.fp8 import FP8, dequantize, quantize


@pytest.mark.parametrize("shape", [(256, 384), (64, 128), (100, 70)])
def test_block_quantization_round_trips_within_fp8_precision(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.linspace(0.01, 3.0, shape[1])  # blocks of unequal scale
    values, scale_inv = quantize(weight, (128, 128))
    assert values.dtype == FP8 and values.shape == weight.shape
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    restored = dequantize(values, scale_inv, (128, 128))
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 of each block's largest value.
    block_max = weight.abs().max()
    assert (restored - weight).abs().max() <= block_max * 2**-4


def dequantized_copy(fp8_dir: Path, target: Path) -> Path:
    """The FP8 checkpoint's weights as float32, without the quantization config."""
    import json
    import shutil

    shutil.copytree(fp8_dir, target, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(fp8_dir / "model.safetensors")
    plain = {
        name: dequantize(t, tensors[f"{name}_scale_inv"], (128, 128)) if t.dtype == FP8 else t
        for name, t in tensors.items()
        if not name.endswith("_scale_inv")
    }
    save_file(plain, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    source = make_tiny_checkpoint(root / "source", "qwen3")
    fp8_dir = make_fp8_checkpoint(source, root / "fp8")
    return fp8_dir, dequantized_copy(fp8_dir, root / "dequantized")


def test_fp8_checkpoint_logits_equal_transformers_on_the_dequantized_weights(fp8_checkpoint):
    fp8_dir, dequantized_dir = fp8_checkpoint
    config = load_model_config(fp8_dir)
    assert config.quantization["weight_block_size"] == [128, 128]
    prompt = [5, 17, 99, 3, 250, 42, 7]
    reference = AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    llm = LLM(str(fp8_dir), dtype="float32", device="cpu", max_model_len=64)
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    top = output.outputs[0].logprobs[0]
    expected_logprobs = expected.log_softmax(-1)
    for token_id, logprob in top.items():
        assert logprob.logprob == pytest.approx(expected_logprobs[token_id].item(), abs=1e-4)
    assert output.outputs[0].token_ids == [int(expected.argmax())]


def test_fp8_weights_load_dequantized_into_the_model_dtype(fp8_checkpoint):
    fp8_dir, dequantized_dir = fp8_checkpoint
    config = EngineConfig(model=str(fp8_dir), device="cpu", dtype="float32")
    ours = load_model(config, weight_reader=fp8.weight_reader_for).model
    plain = load_model(EngineConfig(model=str(dequantized_dir), device="cpu", dtype="float32"))
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), plain.model.state_dict().items(), strict=True
    ):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


def test_other_quantization_methods_are_refused(tmp_path):
    import json

    model_dir = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'awq' .* is not supported"):
        load_model_config(model_dir)


@pytest.mark.gpu
def test_fp8_matmuls_on_cuda_follow_the_dequantized_model(fp8_checkpoint):
    fp8_dir, dequantized_dir = fp8_checkpoint
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    prompts = [[5, 17, 99], [250, 42, 7, 8, 9]]
    fp8_llm = LLM(str(fp8_dir), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    methods = {
        type(m.method).__name__ for m in fp8_llm.engine.model.modules() if hasattr(m, "method")
    }
    assert "Fp8LinearMethod" in methods
    plain_llm = LLM(
        str(dequantized_dir), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2
    )
    ours = [o.outputs[0].token_ids for o in fp8_llm.generate(prompts, params)]
    reference = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    agree = sum(
        a == b for x, y in zip(ours, reference, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert agree >= 0.75 * 32  # 8-bit activations may flip a few near-ties
