"""Find a checkpoint, read its config, build the model and stream its weights in.

    resolve_model_path  local directory | hub id (snapshot_download) | preset (load_format=dummy)
    load_model_config   config.json (transformers 4.x and 5.x styles) -> ModelConfig
    build_model         modules on the meta device, then empty tensors on the target device
    load_weights        safetensors, one tensor at a time, copied (and cast) into place

Only safetensors are loaded: pickle checkpoints (*.bin) can run code when opened, so they are
refused. Peak memory stays near the size of the weights: there is never a second full copy.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from nanoserve.byte_tokenizer import save_byte_level_tokenizer
from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.engine.layers.linear import MergedLinear
from nanoserve.engine.layers.norm import RMSNorm
from nanoserve.engine.layers.rotary import check_rope_scaling
from nanoserve.engine.models.registry import get_model_class

logger = logging.getLogger("nanoserve.loader")

PRESETS_DIR = Path(__file__).parent / "presets"
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.jinja", "*.model", "*.txt"]
DUMMY_INIT_STD = 0.02


class ModelLoadError(ValueError):
    """A checkpoint could not be found, read or matched to the model."""


class LoadedModel(NamedTuple):
    """What `load_model` returns: the model, its config and the directory it came from."""

    model: nn.Module
    model_config: ModelConfig
    model_dir: Path


# ---------------------------------------------------------------------------------------------
# Finding the checkpoint


def resolve_model_path(model: str, load_format: str = "auto") -> Path:
    """A local checkpoint directory for `model` (a path or a hub id), checked for usable files."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_checkpoint_dir(path, model, load_format)
    if path.exists():
        raise ModelLoadError(f"model {model!r} is a file; pass the checkpoint directory instead")
    if _looks_like_path(model):
        raise ModelLoadError(f"model directory {model!r} does not exist")
    if load_format == "dummy" and preset_path(model) is not None:
        return make_dummy_model_dir(model)
    patterns = HUB_ALLOW_PATTERNS
    if load_format == "dummy":  # random weights: the config and tokenizer are enough
        patterns = [p for p in patterns if p != "*.safetensors"]
    return _check_checkpoint_dir(_download(model, patterns), model, load_format)


def _looks_like_path(model: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else is meant as a filesystem path."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model


def _download(model: str, allow_patterns: list[str]) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=allow_patterns))
    except Exception as error:  # network, auth, unknown repo, offline cache miss: all reported
        presets = ", ".join(available_presets())
        raise ModelLoadError(
            f"could not fetch model {model!r} from the Hugging Face Hub "
            f"({type(error).__name__}: {error}). Pass a local checkpoint directory, check the id "
            f"and the network (HF_HUB_OFFLINE=1 uses only the local cache), or use "
            f"--load-format dummy with a preset ({presets})"
        ) from error


def _check_checkpoint_dir(path: Path, model: str, load_format: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {model!r}: no config.json in {path}")
    if load_format != "dummy":
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
    """A directory with the preset config.json of `model_id` and a byte-level tokenizer.

    Kept under $NANOSERVE_CACHE_DIR (default ~/.cache/nanoserve)/dummy so that other processes
    (the front's tokenizer) can load it by path. Written to a temporary directory first and
    renamed into place, so a concurrent reader never sees half a directory.
    """
    preset = preset_path(model_id)
    if preset is None:
        raise ModelLoadError(
            f"no preset for {model_id!r}; presets: {', '.join(available_presets())}"
        )
    root = Path(cache_dir or os.environ.get("NANOSERVE_CACHE_DIR", "~/.cache/nanoserve"))
    root = root.expanduser() / "dummy"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only home directory
        root = Path(tempfile.gettempdir()) / "nanoserve" / "dummy"
        root.mkdir(parents=True, exist_ok=True)
    target = root / model_id.replace("/", "--")
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    shutil.copyfile(preset, staging / "config.json")
    max_len = json.loads(preset.read_text())["max_position_embeddings"]
    save_byte_level_tokenizer(staging, model_max_length=max_len)
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
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{config_path} names no architectures")
    architecture = architectures[0]
    try:
        get_model_class(architecture)
        rope_theta, rope_scaling = _parse_rope(raw)
        check_rope_scaling(rope_scaling)
    except ValueError as error:
        raise ModelLoadError(f"{config_path}: {error}") from None
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{config_path}: hidden_act {raw['hidden_act']!r} is not supported")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{config_path}: mlp_bias=true is not supported")

    def required(key: str):
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
        qk_norm=architecture == "Qwen3ForCausalLM",
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
        eos_token_ids=tuple(_token_ids(raw.get("eos_token_id"))),
    )


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
    uses_window = architecture == "MistralForCausalLM" or raw.get("use_sliding_window", False)
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


def load_generation_config_eos(model_dir: Path) -> set[int]:
    """EOS ids from generation_config.json (int or list); empty when the file is absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    return set(_token_ids(json.loads(path.read_text()).get("eos_token_id")))


# ---------------------------------------------------------------------------------------------
# Building the model and filling its weights


def load_model(
    config: EngineConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> LoadedModel:
    """Resolve, build and fill the model named by `config` (weights or seeded random values)."""
    device = torch.device(device) if device is not None else config.resolve_device()
    model_dir = resolve_model_path(config.model, config.load_format)
    model_config = load_model_config(model_dir)
    dtype = dtype or config.resolve_dtype(model_config.torch_dtype, device)
    model = build_model(model_config, device, dtype)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "%s: %s, %.2fB parameters, %s on %s",
        config.model,
        model_config.architecture,
        num_params / 1e9,
        str(dtype).removeprefix("torch."),
        device,
    )
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, model_dir)
    return LoadedModel(model, model_config, model_dir)


def build_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model with uninitialized `dtype` weights on `device`, in eval mode.

    Built on the meta device first so no time goes into random init that the weights overwrite.
    """
    model_class = get_model_class(model_config.architecture)
    with torch.device("meta"):
        model = model_class(model_config)
    materialized: dict[int, nn.Parameter] = {}  # id(meta param) -> real param; keeps ties tied
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in materialized:
                empty = torch.empty(param.shape, device=device, dtype=dtype)
                materialized[id(param)] = nn.Parameter(empty, requires_grad=False)
            setattr(module, name, materialized[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            # Buffers (the RoPE table) keep their own dtype: float32.
            setattr(module, name, buffer.to(device))
    return model.eval()


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the tensor (or rows of a fused tensor) it is copied into.

    A tied lm_head shares the embedding's tensor, so only `model.embed_tokens.weight` appears.
    """
    destinations: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, MergedLinear):
                parent = module_name.rpartition(".")[0]
                for shard_name in module.shard_names:
                    destinations[f"{parent}.{shard_name}.{param_name}"] = module.shard(
                        param, shard_name
                    )
            else:
                destinations[f"{module_name}.{param_name}"] = param
    return destinations


def _is_ignorable(name: str, tie_word_embeddings: bool) -> bool:
    """Checkpoint tensors we do not need: RoPE buffers, and lm_head when it is tied."""
    return name.endswith("rotary_emb.inv_freq") or (
        tie_word_embeddings and name == "lm_head.weight"
    )


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every safetensors tensor of `model_dir` into `model`, one tensor at a time."""
    started = time.perf_counter()
    destinations = checkpoint_tensors(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    files = weight_files(Path(model_dir))
    names_by_file: dict[Path, list[str]] = {}
    for file in files:  # headers only: check names before copying anything
        with safe_open(file, framework="pt", device="cpu") as f:
            names = f.keys()  # a safe_open handle is not iterable itself
        names_by_file[file] = [n for n in names if not _is_ignorable(n, tied)]
    found = {name for names in names_by_file.values() for name in names}
    missing = sorted(set(destinations) - found)
    unexpected = sorted(found - set(destinations))
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint {model_dir} does not match the model built from its config.json: "
            f"missing tensors {_preview(missing)}; unexpected tensors {_preview(unexpected)}"
        )

    total = len(found)
    log_every = max(1, total // 10)
    done = 0
    with torch.no_grad():
        for shard_index, file in enumerate(files, start=1):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names_by_file[file]:
                    tensor = f.get_tensor(name)
                    destination = destinations[name]
                    if tensor.shape != destination.shape:
                        raise ModelLoadError(
                            f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"but config.json implies {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)  # casts to the model dtype, moves to its device
                    del tensor
                    done += 1
                    if done % log_every == 0 or done == total:
                        logger.info(
                            "loading weights: shard %d/%d, %d/%d tensors",
                            shard_index,
                            len(files),
                            done,
                            total,
                        )
    logger.info("loaded %d tensors in %.1f s", total, time.perf_counter() - started)


def _preview(names: list[str], limit: int = 5) -> str:
    if not names:
        return "(none)"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights: norms 1, biases 0, everything else N(0, 0.02)."""
    generators: dict[torch.device, torch.Generator] = {}
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta":
                continue
            if id(param) in norm_weights:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(param.device).manual_seed(seed)
                param.normal_(0.0, DUMMY_INIT_STD, generator=generators[param.device])
