"""Finding a checkpoint and reading its config.json, without torch (both processes use it).

    resolve_checkpoint   the demo name | local directory | hub id (snapshot_download) | preset
    resolve_tokenizer    a tokenizer directory or hub id (--tokenizer), tokenizer files only
    weight_files         the safetensors files of a checkpoint (its index's shards, or every one)
    load_model_config    config.json (transformers 4.x and 5.x styles) -> ModelConfig

The front resolves a checkpoint without its weights (config and tokenizer files are enough to
validate limits and tokenize); the worker resolves it with them. Only safetensors are loaded:
pickle checkpoints (*.bin) can run code when opened, so they are refused.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from nanoserve.common.config import ModelConfig, MoeConfig
from nanoserve.text.byte_tokenizer import save_byte_level_tokenizer

logger = logging.getLogger("nanoserve.common.checkpoint")

PACKAGE_DIR = Path(__file__).parents[1]  # nanoserve/
PRESETS_DIR = PACKAGE_DIR / "presets"
# The small model shipped in the package, served and loaded under a short name.
DEMO_MODEL_NAME = "nanoserve-demo"
DEMO_MODEL_DIR = PACKAGE_DIR / "assets" / "demo"
METADATA_PATTERNS = ["*.json", "tokenizer*", "*.jinja", "*.model", "*.txt"]
WEIGHT_PATTERNS = ["*.safetensors"]
# How alike (difflib's ratio) a name the hub does not know must be to a known one to suggest it.
NAME_SIMILARITY_CUTOFF = 0.8

# Llama, Mistral, Qwen2 and Qwen3 are one model family with small switches (core/models/);
# the mixture-of-experts models are a plug-in (nanoserve/moe/).
DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
# rope_type -> the keys its rope_scaling dict must carry
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class ModelLoadError(ValueError):
    """A checkpoint could not be found, read or matched to the model."""


# ---------------------------------------------------------------------------------------------
# Finding the checkpoint


def resolve_checkpoint(
    model: str,
    load_format: str = "auto",
    with_weights: bool = True,
    revision: str | None = None,
    download_dir: str | None = None,
) -> Path:
    """A local checkpoint directory for `model` (a path or a hub id), checked for usable files.

    `nanoserve-demo` names the demo model shipped in the package. `with_weights=False` (the
    front) downloads only config and tokenizer files from the hub; a dummy load format never
    needs weights. `revision` and `download_dir` are the hub's branch, tag or commit and cache.
    """
    if model == DEMO_MODEL_NAME:
        return _check_checkpoint_dir(DEMO_MODEL_DIR, model, load_format, with_weights)
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_checkpoint_dir(path, model, load_format, with_weights)
    if path.exists():
        raise ModelLoadError(f"model {model!r} is a file; pass the checkpoint directory instead")
    if _looks_like_path(model):
        raise ModelLoadError(f"model directory {model!r} does not exist")
    if load_format == "dummy" and preset_path(model) is not None:
        return make_dummy_model_dir(model)
    needs_weights = with_weights and load_format != "dummy"
    patterns = METADATA_PATTERNS + (WEIGHT_PATTERNS if needs_weights else [])
    local_dir = _download(model, patterns, revision, download_dir)
    return _check_checkpoint_dir(local_dir, model, load_format, with_weights)


def resolve_tokenizer(name: str, download_dir: str | None = None) -> Path:
    """A local directory with the tokenizer files of `name` (a directory, a hub id or the demo)."""
    if name == DEMO_MODEL_NAME:
        return DEMO_MODEL_DIR
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or _looks_like_path(name):
        raise ModelLoadError(f"tokenizer directory {name!r} does not exist")
    return _download(name, METADATA_PATTERNS, None, download_dir)


def _looks_like_path(model: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else is meant as a filesystem path."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model


def _download(
    model: str, allow_patterns: list[str], revision: str | None, download_dir: str | None
) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model, allow_patterns=allow_patterns, revision=revision, cache_dir=download_dir
            )
        )
    except Exception as error:  # network, auth, unknown repo, offline cache miss: all reported
        reason = " ".join(f"{type(error).__name__}: {error}".split())  # one line, always
        failed = f"could not fetch model {model!r} from the Hugging Face Hub ({reason})"
        if model in available_presets():  # the name is right: the download is what failed
            raise ModelLoadError(
                f"{failed}; --load-format dummy serves its shape with random weights, no download"
            ) from error
        meant = _name_meant(model)
        if meant is not None:
            raise ModelLoadError(f"{failed}; did you mean {meant!r}?") from error
        presets = ", ".join(available_presets())
        raise ModelLoadError(
            f"{failed}. Pass a local checkpoint directory, check the id and the network "
            f"(HF_HUB_OFFLINE=1 uses only the local cache), or use --load-format dummy with a "
            f"preset ({presets})"
        ) from error


def _name_meant(model: str) -> str | None:
    """The demo's or a preset's name when `model` is one of them mistyped (`nanoserve-dmo`)."""
    names = [DEMO_MODEL_NAME, *available_presets()]
    matches = difflib.get_close_matches(model, names, n=1, cutoff=NAME_SIMILARITY_CUTOFF)
    return matches[0] if matches else None


def _check_checkpoint_dir(path: Path, model: str, load_format: str, with_weights: bool) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {model!r}: no config.json in {path}")
    if with_weights and load_format != "dummy":
        weight_files(path, model)  # raises when there are no usable weights
    return path


def weight_files(model_dir: Path, model: str | None = None) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of its index, or every *.safetensors."""
    name = model or str(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = [model_dir / file for file in sorted(set(weight_map.values()))]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise ModelLoadError(
                f"model {name!r}: {index_path.name} lists shards that are not in {model_dir}: "
                f"{', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise ModelLoadError(
            f"model {name!r} has only PyTorch pickle weights ({', '.join(pickles)}); nanoserve "
            f"loads *.safetensors only, because pickle files can run code when loaded. Convert "
            f"the checkpoint with transformers' save_pretrained(safe_serialization=True)"
        )
    raise ModelLoadError(f"model {name!r}: no *.safetensors weight files in {model_dir}")


# ---------------------------------------------------------------------------------------------
# Presets: published config.json files for --load-format dummy without the hub


def available_presets() -> list[str]:
    """Hub ids that have a shipped config.json preset."""
    return sorted(p.stem.replace("--", "/") for p in PRESETS_DIR.glob("*.json"))


def preset_path(model_id: str) -> Path | None:
    path = PRESETS_DIR / f"{model_id.replace('/', '--')}.json"
    return path if path.is_file() else None


def make_dummy_model_dir(model_id: str, cache_dir: Path | None = None) -> Path:
    """A directory with the preset config.json of `model_id` and a byte-level tokenizer that
    decodes every id of the model's vocabulary to visible text.

    Kept under $NANOSERVE_CACHE_DIR (default ~/.cache/nanoserve)/dummy-checkpoints so that other
    processes (the front's tokenizer) can load it by path. Written to a temporary directory first
    and renamed into place, so a concurrent reader never sees half a directory.
    """
    preset = preset_path(model_id)
    if preset is None:
        raise ModelLoadError(
            f"no preset for {model_id!r}; presets: {', '.join(available_presets())}"
        )
    root = Path(cache_dir or os.environ.get("NANOSERVE_CACHE_DIR", "~/.cache/nanoserve"))
    root = root.expanduser() / "dummy-checkpoints"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only home directory
        root = Path(tempfile.gettempdir()) / "nanoserve" / "dummy-checkpoints"
        root.mkdir(parents=True, exist_ok=True)
    target = root / model_id.replace("/", "--")
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    shutil.copyfile(preset, staging / "config.json")
    raw = json.loads(preset.read_text())
    save_byte_level_tokenizer(
        staging, model_max_length=raw["max_position_embeddings"], vocab_size=raw["vocab_size"]
    )
    try:
        staging.rename(target)
    except OSError:  # another process got there first; its copy is identical
        shutil.rmtree(staging)
    logger.info("dummy checkpoint for %s (preset config, byte tokenizer) in %s", model_id, target)
    return target


# ---------------------------------------------------------------------------------------------
# Reading config.json


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse a checkpoint's config.json (transformers 4.x or 5.x style) into a ModelConfig."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {model_dir}")
    raw = json.loads(config_path.read_text())
    architecture = _check_supported(raw, config_path)
    try:
        rope_theta, rope_scaling = _parse_rope(raw)
        check_rope_scaling(rope_scaling)
    except ValueError as error:
        raise ModelLoadError(f"{config_path}: {error}") from None

    def required(key: str) -> Any:
        if key not in raw:
            raise ModelLoadError(f"{config_path} has no {key!r}")
        return raw[key]

    hidden_size = required("hidden_size")
    num_heads = required("num_attention_heads")
    return ModelConfig(
        architecture=architecture,
        vocab_size=required("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=required("intermediate_size"),
        num_hidden_layers=required("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden_size // num_heads,
        max_position_embeddings=_max_positions(raw, architecture, config_path),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; its config.json does not say so.
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        eos_token_ids=tuple(_token_ids(raw.get("eos_token_id"))),
        quantization=_quantization(raw, config_path),
        moe=_moe(raw, architecture, config_path),
    )


def _moe(raw: dict[str, Any], architecture: str, config_path: Path) -> MoeConfig | None:
    """The experts of a mixture-of-experts config.json (None for a dense model).

    Qwen3-MoE names its expert count `num_experts` (transformers 5.x writes
    `num_local_experts`, Mixtral's name) and its expert width `moe_intermediate_size`; Mixtral's
    experts are `intermediate_size` wide, every layer is sparse and the top-k is renormalized.
    """
    if architecture not in MOE_ARCHITECTURES:
        return None
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not num_experts or "num_experts_per_tok" not in raw:
        raise ModelLoadError(f"{config_path} names no experts (num_experts, num_experts_per_tok)")
    is_mixtral = architecture == "MixtralForCausalLM"
    width_key = "intermediate_size" if is_mixtral else "moe_intermediate_size"
    try:
        return MoeConfig(
            num_experts=num_experts,
            num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw[width_key],
            norm_topk_prob=is_mixtral or bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=1 if is_mixtral else raw.get("decoder_sparse_step", 1),
            mlp_only_layers=() if is_mixtral else tuple(raw.get("mlp_only_layers") or ()),
        )
    except (KeyError, ValueError) as error:
        raise ModelLoadError(f"{config_path}: {error}") from None


def _check_supported(raw: dict[str, Any], config_path: Path) -> str:
    """The architecture named by config.json, if we serve it and its activation and biases."""
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{config_path} names no architectures")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{config_path}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{config_path}: hidden_act {raw['hidden_act']!r} is not supported")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{config_path}: mlp_bias=true is not supported")
    return architecture


def _quantization(raw: dict[str, Any], config_path: Path) -> dict | None:
    """A checkpoint's quantization_config, if it is one we load (block-scaled FP8)."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method")
    if method != "fp8" or config.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(
            f"{config_path}: quantization {method!r} ({config.get('fmt', '')}) is not supported; "
            "supported: block-scaled fp8 (e4m3) checkpoints"
        )
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"{config_path}: only dynamic FP8 activation scales are supported")
    return dict(config)


def check_rope_scaling(rope_scaling: dict | None) -> None:
    """Raise ValueError unless `rope_scaling` is None or a supported, complete scaling dict."""
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_SCALING_KEYS)}"
        )
    missing = [key for key in ROPE_SCALING_KEYS[rope_type] if key not in (rope_scaling or {})]
    if missing:
        raise ValueError(f"rope scaling of type {rope_type!r} is missing {', '.join(missing)}")


def _parse_rope(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from 5.x `rope_parameters` or 4.x top-level keys."""
    if raw.get("rope_parameters") is not None:  # transformers 5.x: one dict holds everything
        params = dict(raw["rope_parameters"])
        theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    else:  # transformers 4.x: rope_theta, plus rope_scaling (null when unscaled)
        params = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    legacy_type = params.pop("type", None)  # older configs say "type"
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}


def _max_positions(raw: dict, architecture: str, config_path: Path) -> int:
    """max_position_embeddings, capped at a sliding window we do not implement."""
    max_positions = raw.get("max_position_embeddings")
    if max_positions is None:
        raise ModelLoadError(f"{config_path} has no 'max_position_embeddings'")
    window = raw.get("sliding_window")
    uses_window = architecture in ("MistralForCausalLM", "MixtralForCausalLM") or raw.get(
        "use_sliding_window", False
    )
    if uses_window and window is not None and window < max_positions:
        # Within the window, full attention is exact; beyond it we would differ. Cap instead.
        logger.warning(
            "%s: sliding-window attention (%d) is not implemented; context capped at %d tokens",
            config_path,
            window,
            window,
        )
        return window
    return max_positions


def _token_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


# generation_config.json fields that become default sampling parameters, as vLLM takes them
# (`--generation-config auto`); HF's max_new_tokens is our max_tokens.
GENERATION_DEFAULT_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def load_generation_defaults(config_dir: Path) -> dict[str, Any]:
    """The sampling defaults a model's creator put in `config_dir`/generation_config.json
    (empty when there is none): request fields left unset take these before our own."""
    path = Path(config_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    defaults = {k: config[k] for k in GENERATION_DEFAULT_FIELDS if config.get(k) is not None}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def load_generation_config_eos(model_dir: Path) -> set[int]:
    """EOS ids from generation_config.json (int or list); empty when the file is absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    return set(_token_ids(json.loads(path.read_text()).get("eos_token_id")))
