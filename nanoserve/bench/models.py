"""Dummy-weight checkpoints for benchmarks: a Qwen3 shape, seeded weights, a byte tokenizer.

Every arm loads the same files from disk, so nothing is downloaded. Random weights give random
text, so two choices keep the comparison honest:

- weights are drawn at a scale where logits are well spread (bf16 greedy ties are rare), and
- the output-embedding rows of every token except printable ASCII and newline are zeroed, so
  greedy decoding never picks EOS (each request runs to max_tokens on every server) nor a byte
  that only decodes as part of a multi-byte character (each token is one visible character).
  The LM head still multiplies the full vocabulary, so the cost per token is the real shape's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EOS_TOKEN_ID = 258  # <|im_end|> of nanoserve.text.byte_tokenizer
PAD_TOKEN_ID = 256  # <|endoftext|>

_COMMON: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}

# Shapes of well-known checkpoints (from their config.json), two small ones for tests, and a
# small float32 model (issue 14's "small" row: where per-step overheads, not weights, dominate).
PRESETS: dict[str, dict[str, Any]] = {
    "test": {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
    },
    "tiny": {
        "vocab_size": 320,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
    },
    "small-fp32": {
        "vocab_size": 320,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 4096,
    },
    "qwen3-0.6b": {
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
    },
    "qwen3-1.7b": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
    },
}

# Presets whose checkpoint is not written in bfloat16.
PRESET_DTYPES = {"small-fp32": torch.float32}

# Token ids (= byte values in the byte tokenizer) greedy decoding may produce.
ALLOWED_OUTPUT_IDS = [10, *range(32, 127)]


def make_dummy_checkpoint(directory: str | Path, preset: str, seed: int = 0) -> Path:
    """Write a Qwen3 checkpoint of `preset`'s shape (bf16 unless `PRESET_DTYPES` says otherwise)
    with seeded weights and a byte tokenizer.

    Reuses `directory` when it already holds the same preset and seed (see `bench_model.json`).
    """
    import transformers

    from nanoserve.text.byte_tokenizer import save_byte_level_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    directory = Path(directory)
    dtype = PRESET_DTYPES.get(preset, torch.bfloat16)
    dtype_name = str(dtype).removeprefix("torch.")
    stamp = {"preset": preset, "seed": seed, "dtype": dtype_name, "format": 1}
    stamp_path = directory / "bench_model.json"
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3Config(**_COMMON, **PRESETS[preset])
    started = time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu")  # non-persistent buffers (rotary) are not saved
    model.tie_weights()  # to_empty gave the tied head its own storage
    init_seeded_weights(model, seed)
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    model.save_pretrained(str(directory), safe_serialization=True)
    save_byte_level_tokenizer(directory, model_max_length=config.max_position_embeddings)
    stamp_path.write_text(json.dumps(stamp))
    print(
        f"wrote dummy {preset} checkpoint to {directory} in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return directory


@torch.no_grad()
def init_seeded_weights(model: PreTrainedModel, seed: int) -> None:
    """Seeded weights: norms ≈ 1, linears ~ N(0, 1/fan_in), embeddings ~ N(0, 0.1²)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        elif "embed_tokens" in name or name.startswith("lm_head"):
            values = 0.1 * torch.randn(param.shape, generator=generator)
        else:
            values = torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5
        param.copy_(values.to(param.dtype))
    head = model.get_output_embeddings().weight  # [vocab, hidden]
    keep = torch.zeros(head.shape[0], dtype=torch.bool)
    keep[ALLOWED_OUTPUT_IDS] = True
    head[~keep] = 0.0


def decode_weight_bytes(model_dir: str | Path) -> int:
    """Bytes of weights one decode token reads: all tensors, less an untied input embedding;
    of a mixture-of-experts model's experts only the share a token picks (top-k of E)."""
    from safetensors import safe_open

    config = json.loads((Path(model_dir) / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    experts = config.get("num_experts") or config.get("num_local_experts")
    picked = config.get("num_experts_per_tok", 1) / experts if experts else 1.0
    total = 0.0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("embed_tokens.weight") and not tied:
                    continue
                tensor_slice = f.get_slice(key)
                numel = 1
                for dim in tensor_slice.get_shape():
                    numel *= dim
                share = picked if ".experts." in key else 1.0
                total += numel * _DTYPE_BYTES[tensor_slice.get_dtype()] * share
    return round(total)


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8}
