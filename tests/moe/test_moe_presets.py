"""The MoE presets (`--load-format dummy`) build with their published shapes: the parameter
count, and exactly the checkpoint tensors transformers' model of the same config holds."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nanoserve.common.config import EngineConfig
from nanoserve.core.loader import checkpoint_tensors, load_model
from nanoserve.moe.models import moe_model_classes

PUBLISHED_NUM_PARAMS = {
    "Qwen/Qwen3-30B-A3B": 30.5e9,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.7e9,
}
STACKED = re.compile(r"(.*)\.experts\.(gate_up_proj|down_proj)$")


def per_expert_names(name: str, shape: tuple[int, ...], names: tuple[str, str, str]) -> dict:
    """transformers 5.x holds experts stacked ([E, 2I, H], [E, H, I]) but saves and loads them
    one tensor per expert: the names and shapes of a checkpoint."""
    match = STACKED.match(name)
    if match is None:
        return {name: shape}
    prefix, which = match.groups()
    gate, up, down = names
    if which == "down_proj":
        return {f"{prefix}.experts.{e}.{down}.weight": shape[1:] for e in range(shape[0])}
    half = (shape[1] // 2, shape[2])
    return {
        f"{prefix}.experts.{e}.{part}.weight": half for e in range(shape[0]) for part in (gate, up)
    }


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_NUM_PARAMS))
def test_moe_preset_builds_with_published_shapes(model_id, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    config = EngineConfig(model=model_id, load_format="dummy")
    loaded = load_model(config, device="meta", model_classes=moe_model_classes())
    num_params = sum(p.numel() for p in loaded.model.parameters())
    assert abs(num_params - PUBLISHED_NUM_PARAMS[model_id]) / PUBLISHED_NUM_PARAMS[model_id] < 0.01

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(loaded.model_dir))
    is_mixtral = "Mixtral" in model_id
    names = ("w1", "w3", "w2") if is_mixtral else ("gate_proj", "up_proj", "down_proj")
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in reference.state_dict().items():
        if is_mixtral:  # transformers' module is `mlp`, Mixtral's checkpoints say so
            name = name.replace(".mlp.", ".block_sparse_moe.")
        expected.update(per_expert_names(name, tuple(tensor.shape), names))
    ours = {name: tuple(t.shape) for name, (t, _) in checkpoint_tensors(loaded.model).items()}
    assert ours == expected
    assert num_params == reference.num_parameters()
