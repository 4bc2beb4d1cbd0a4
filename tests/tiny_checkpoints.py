"""Tiny random Hugging Face checkpoints for tests and benchmarks (no hub download).

Each checkpoint is made the way a real one is: a transformers config and model with a seeded
random init, `save_pretrained` to safetensors, and a byte-level `tokenizer.json` beside it.
transformers is used here only to *write* reference checkpoints; nanoserve never runs its
modeling code.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanoserve.text.byte_tokenizer import SPECIAL_TOKENS, save_byte_level_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCHITECTURES = ("qwen3", "qwen2", "llama", "mistral")
# Mixture-of-experts models (nanoserve/moe/, a plug-in: engines need its model classes).
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")

# Small enough to run in milliseconds, big enough to exercise GQA, several blocks and layers.
_TINY: dict[str, Any] = {
    "vocab_size": 320,  # 256 bytes + specials, padded
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": None,
    "eos_token_id": 258,  # <|im_end|>
    "pad_token_id": 256,  # <|endoftext|>
}


def tiny_config(architecture: str = "qwen3", **overrides: Any) -> PretrainedConfig:
    """A transformers config object for a tiny model of `architecture`."""
    import transformers

    values = dict(_TINY)
    cls: type[PretrainedConfig]
    if architecture == "qwen3":
        cls = transformers.Qwen3Config
        values.update(head_dim=32, tie_word_embeddings=True)
    elif architecture == "qwen2":
        cls = transformers.Qwen2Config
        values.update(tie_word_embeddings=False)
    elif architecture == "llama":
        cls = transformers.LlamaConfig
        values.update(
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
    elif architecture == "mistral":
        cls = transformers.MistralConfig
        values.update(tie_word_embeddings=False, sliding_window=None)
    elif architecture == "qwen3_moe":
        # 3 layers: two sparse ones around a dense one (mlp_only_layers), 8 experts, top 3.
        cls = transformers.Qwen3MoeConfig
        values.update(
            head_dim=32,
            tie_word_embeddings=False,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    elif architecture == "mixtral":
        cls = transformers.MixtralConfig
        values.update(
            tie_word_embeddings=False,
            sliding_window=None,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
        )
    else:
        known = ARCHITECTURES + MOE_ARCHITECTURES
        raise ValueError(f"unknown architecture {architecture!r}; choose from {known}")
    values.update(overrides)
    return cls(**values)


def make_tiny_checkpoint(
    directory: str | Path,
    architecture: str = "qwen3",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files."""
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(architecture, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    _scale_up_init(model, seed)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(str(directory), safe_serialization=True)
    save_byte_level_tokenizer(directory, model_max_length=config.max_position_embeddings)
    assert len(SPECIAL_TOKENS) + 256 <= config.vocab_size
    return directory


def _scale_up_init(model: torch.nn.Module, seed: int) -> None:
    """Re-draw weights with a larger std so logits are far from uniform (greedy ties are rare)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.copy_((1.0 + noise).to(param.dtype))
            else:
                param.copy_((torch.randn(param.shape, generator=generator) * 0.2).to(param.dtype))


# Linear weights a block-scaled FP8 checkpoint stores in 8 bits (norms, embeddings and the LM
# head stay in the model dtype, as in Qwen3-*-FP8).
FP8_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_fp8_checkpoint(
    source: str | Path, target: str | Path, block_size: tuple[int, int] = (128, 128)
) -> Path:
    """A copy of checkpoint `source` in the block-scaled FP8 format, written by hand.

    Each linear weight becomes float8_e4m3fn plus a `<name>_scale_inv` tensor of per-block
    scales, and config.json gets the `quantization_config` that Qwen3-*-FP8 checkpoints carry.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from nanoserve.quantization.fp8 import quantize

    source, target = Path(source), Path(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.endswith(".weight") and name.split(".")[-2] in FP8_LINEAR_NAMES:
                tensors[name], tensors[f"{name}_scale_inv"] = quantize(tensor, block_size)
            else:
                tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block_size),
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
