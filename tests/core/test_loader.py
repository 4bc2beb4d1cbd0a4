"""Building the model and loading its weights (the worker's half of loading)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import make_tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from nanoserve.common.checkpoint import ModelLoadError, available_presets
from nanoserve.common.config import EngineConfig
from nanoserve.core import loader
from nanoserve.core.loader import checkpoint_tensors, format_count, load_model, resolve_dtype

# Published parameter counts (embeddings included, a tied head counted once).
PUBLISHED_NUM_PARAMS = {
    "Qwen/Qwen3-0.6B": 596_049_920,
    "Qwen/Qwen3-1.7B": 1.72e9,
    "Qwen/Qwen3-4B": 4.02e9,
    "Qwen/Qwen3-8B": 8.19e9,
    "meta-llama/Llama-3.2-1B": 1.24e9,
    "Qwen/Qwen2.5-0.5B": 0.494e9,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ("qwen3", "qwen2", "llama")}


def load(model_dir: Path, **overrides):
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **overrides)
    return load_model(config)


def copy_checkpoint(source: Path, target: Path, config_edit=None) -> Path:
    """A copy of `source` whose config.json is passed through `config_edit` first."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    if config_edit is not None:
        raw = json.loads((source / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config_edit(raw)))
    return target


# --- weights ---------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically(checkpoints, tmp_path, caplog):
    source = checkpoints["llama"]
    hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    num_shards = len(list(sharded.glob("*.safetensors")))
    assert num_shards > 1

    with caplog.at_level(logging.INFO, logger="nanoserve.loader"):
        sharded_model = load(sharded).model
    # One progress line per shard, then one summary line.
    progress = [r.getMessage() for r in caplog.records if "loading weights" in r.getMessage()]
    assert len(progress) == num_shards
    assert progress[-1].startswith(f"loading weights: shard {num_shards}/{num_shards} (")
    assert "loaded 21 tensors" in caplog.text
    single = load(source).model.state_dict()
    for name, tensor in sharded_model.state_dict().items():
        assert torch.equal(tensor, single[name]), name


def test_weights_land_in_fused_projections(checkpoints):
    model = load(checkpoints["qwen2"]).model
    weights = load_file(checkpoints["qwen2"] / "model.safetensors")
    destinations = checkpoint_tensors(model)
    assert set(destinations) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(destinations[name][0], tensor), name
    attention = model.model.layers[1].self_attn
    q, k, v = attention.qkv_proj.bias.split([64, 32, 32])
    assert torch.equal(k, weights["model.layers.1.self_attn.k_proj.bias"])


def test_checkpoint_dtype_is_cast(checkpoints):
    model = load_model(
        EngineConfig(model=str(checkpoints["qwen3"]), device="cpu", dtype="bfloat16")
    ).model
    weights = load_file(checkpoints["qwen3"] / "model.safetensors")
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"].bfloat16())
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_resolves_as_vllm_does_on_cpu(monkeypatch, caplog, native_bf16):
    monkeypatch.setattr(loader, "has_native_bf16", lambda: native_bf16)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="nanoserve.loader"):
        fp32 = resolve_dtype("auto", "float32", cpu)
    # A float32 checkpoint runs in bfloat16 where the CPU has bf16 instructions, said in a log.
    assert fp32 == (torch.bfloat16 if native_bf16 else torch.float32)
    assert ("Downcasting torch.float32 to torch.bfloat16" in caplog.text) == native_bf16
    assert resolve_dtype("auto", "float16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", cpu) == torch.bfloat16
    # An explicit dtype is taken as it is.
    assert resolve_dtype("float32", "float32", cpu) == torch.float32
    assert resolve_dtype("float16", "bfloat16", cpu) == torch.float16


def test_missing_and_unexpected_tensors_are_named(checkpoints, tmp_path):
    model_dir = copy_checkpoint(checkpoints["llama"], tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # ignored
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load(model_dir)
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in str(error.value)
    assert "unexpected tensors model.layers.1.mlp.extra.weight" in str(error.value)


def test_tied_checkpoint_may_carry_lm_head(checkpoints, tmp_path):
    model_dir = copy_checkpoint(checkpoints["qwen3"], tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    model = load(model_dir).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dummy_weights_are_seeded(checkpoints):
    first = load(checkpoints["qwen2"], load_format="dummy", seed=3).model.state_dict()
    again = load(checkpoints["qwen2"], load_format="dummy", seed=3).model.state_dict()
    other = load(checkpoints["qwen2"], load_format="dummy", seed=4).model.state_dict()
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])
    assert 0.015 < first[name].std().item() < 0.025
    assert torch.all(first["model.layers.1.input_layernorm.weight"] == 1.0)
    assert torch.all(first["model.layers.1.self_attn.qkv_proj.bias"] == 0.0)


# --- presets ---------------------------------------------------------------------------------


def test_all_presets_shipped():
    moe_presets = {"Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-Instruct-v0.1"}  # tests/moe
    assert sorted(PUBLISHED_NUM_PARAMS) == sorted(set(available_presets()) - moe_presets)


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_NUM_PARAMS))
def test_preset_builds_with_published_shapes(model_id, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    # The meta device checks every shape without allocating gigabytes.
    config = EngineConfig(model=model_id, load_format="dummy")
    model, model_config, model_dir = load_model(config, device="meta")
    assert model_dir == tmp_path / "dummy-checkpoints" / model_id.replace("/", "--")
    assert (model_dir / "tokenizer.json").is_file()
    assert model_config.torch_dtype == "bfloat16"
    assert next(model.parameters()).dtype == torch.bfloat16  # `auto` keeps the checkpoint dtype

    num_params = sum(p.numel() for p in model.parameters())
    published = PUBLISHED_NUM_PARAMS[model_id]
    assert abs(num_params - published) / published < 0.01

    # transformers, built from the same config, expects exactly these checkpoint tensors.
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    expected = {
        name: tuple(t.shape)
        for name, t in reference.state_dict().items()
        if not (model_config.tie_word_embeddings and name == "lm_head.weight")
    }
    ours = {name: tuple(t.shape) for name, (t, _) in checkpoint_tensors(model).items()}
    assert ours == expected
    assert num_params == reference.num_parameters()


@pytest.mark.parametrize(
    ("count", "text"),
    [(4_197_120, "4.20M"), (1_720_574_976, "1.72B"), (596_049_920, "596.05M"), (12_345, "12.35K")],
)
def test_parameter_counts_read_as_people_write_them(count, text):
    assert format_count(count) == text


def test_the_demo_model_logs_its_parameter_count_and_one_shard_line(caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve.loader"):
        load_model(EngineConfig(model="nanoserve-demo", device="cpu"))
    assert "Qwen3ForCausalLM, 4.20M parameters" in caplog.text
    assert caplog.text.count("loading weights: shard") == 1
