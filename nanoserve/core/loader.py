"""Build the model and fill its weights: the worker's half of loading a checkpoint.

    resolve_device, resolve_dtype   what `auto` means on this machine
    build_model                     modules on the meta device, then empty tensors on the target
    load_weights                    safetensors, one tensor at a time, copied (and cast) into place
    init_dummy_weights              seeded random values (--load-format dummy)

Finding the checkpoint and its config.json is `common/checkpoint.py`'s (torch-free, shared with
the front). Peak memory stays near the size of the weights: never a second full copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from nanoserve.common.checkpoint import (
    ModelLoadError,
    load_model_config,
    resolve_checkpoint,
    weight_files,
)
from nanoserve.common.config import EngineConfig, ModelConfig, resolve_auto_dtype
from nanoserve.common.cpu_features import has_native_bf16
from nanoserve.core.layers.linear import CheckpointSlice, CheckpointTargets
from nanoserve.core.layers.norm import RMSNorm
from nanoserve.core.models.base import CausalLM
from nanoserve.core.models.registry import ModelClass, get_model_class
from nanoserve.core.parallel import TensorParallel

logger = logging.getLogger("nanoserve.loader")

DUMMY_INIT_STD = 0.02


class LoadedModel(NamedTuple):
    """What `load_model` returns: the model, its config and the directory it came from."""

    model: CausalLM
    model_config: ModelConfig
    model_dir: Path


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when present, else the CPU; asking for CUDA without it is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device '{device}' was asked for, but this torch ({torch.__version__}) sees no CUDA "
            "device; use device 'cpu' (device 'auto' picks CUDA when there is one)"
        )
    return torch.device(device)


def resolve_dtype(dtype: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """An explicit dtype as it is; `auto` as vLLM resolves it (`config.resolve_auto_dtype`)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    has_bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else has_native_bf16()
    resolved = resolve_auto_dtype(checkpoint_dtype, device.type, has_bf16)
    if checkpoint_dtype == "float32" and resolved != "float32":
        logger.warning("Downcasting torch.float32 to torch.%s (--dtype float32 keeps it)", resolved)
    return getattr(torch, resolved)


# ---------------------------------------------------------------------------------------------
# Building the model and filling its weights


def load_model(
    config: EngineConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    tp: TensorParallel | None = None,
    weight_reader: Callable[[ModelConfig], WeightReader] | None = None,
    model_classes: Mapping[str, ModelClass] | None = None,
) -> LoadedModel:
    """Resolve, build and fill the model named by `config` (weights or seeded random values).

    With tensor parallelism (`tp`) the model holds this rank's shard, read from the checkpoint
    slice by slice: no process ever holds the whole model. `weight_reader` gives the reader for
    the checkpoint's format (default: the tensors as they are); `model_classes` are plug-ins'.
    """
    device = torch.device(device) if device is not None else resolve_device(config.device)
    model_dir = resolve_checkpoint(
        config.model,
        config.load_format,
        revision=config.revision,
        download_dir=config.download_dir,
    )
    model_config = load_model_config(model_dir)
    dtype = dtype or resolve_dtype(config.dtype, model_config.torch_dtype, device)
    model = build_model(model_config, device, dtype, tp, model_classes)
    num_params = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    logger.info(
        "%s: %s, %s parameters, %s on %s",
        config.model,
        model_config.architecture,
        format_count(num_params),
        str(dtype).removeprefix("torch."),
        device,
    )
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        reader = weight_reader(model_config) if weight_reader is not None else None
        load_weights(model, model_dir, reader)
    return LoadedModel(model, model_config, model_dir)


def format_count(count: int) -> str:
    """4197120 -> '4.20M', 1720574976 -> '1.72B': a parameter count as people write it."""
    for divisor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= divisor:
            return f"{count / divisor:.2f}{suffix}"
    return str(count)


def build_model(
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
    model_classes: Mapping[str, ModelClass] | None = None,
) -> CausalLM:
    """The model with uninitialized `dtype` weights on `device`, in eval mode.

    Built on the meta device first so no time goes into random init that the weights overwrite.
    """
    model_class = get_model_class(model_config.architecture, model_classes)
    with torch.device("meta"):
        model = model_class(model_config, tp)
    materialized: dict[int, nn.Parameter] = {}  # id(meta param) -> real param; keeps ties tied
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in materialized:
                materialized[id(param)] = nn.Parameter(_empty(model, param, dtype, device))
            setattr(module, name, materialized[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            # Buffers (the RoPE table) keep their own dtype: float32.
            setattr(module, name, buffer.to(device))
    return model.eval()


def _empty(model: nn.Module, param: torch.Tensor, dtype: torch.dtype, device: torch.device):
    """An uninitialized tensor for `param`; a device too small for the weights is a ValueError."""
    try:
        return torch.empty(param.shape, device=device, dtype=dtype).requires_grad_(False)
    except torch.OutOfMemoryError as error:
        unique = {id(p): p for p in model.parameters()}.values()  # a tied head counts once
        gib = sum(p.numel() for p in unique) * torch.finfo(dtype).bits / 8 / 2**30
        raise ValueError(
            f"the model's weights need {gib:.1f} GiB in {str(dtype).removeprefix('torch.')}, "
            f"more than {device} has free ({error}); use a smaller model or dtype, or a larger "
            "device"
        ) from None


def checkpoint_tensors(model: nn.Module) -> CheckpointTargets:
    """Checkpoint tensor name -> (the parameter, or part of it, it fills; the slice to read).

    Layers that fuse or shard their weights say where each checkpoint tensor goes
    (`checkpoint_targets`). A tied lm_head shares the embedding's tensor, so only
    `model.embed_tokens.weight` appears."""
    destinations: CheckpointTargets = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            targets = getattr(module, "checkpoint_targets", None)
            if targets is not None:
                destinations.update(targets(module_name, param_name, param))
            else:
                destinations[f"{module_name}.{param_name}"] = (param, None)
    return destinations


class WeightReader:
    """Reads checkpoint tensors: the safetensors as they are, a slice when a rank holds a shard.

    A quantized checkpoint format brings its own (`FastPaths.weight_reader`: FP8 checkpoints
    dequantize here); it may also hold tensors that are not weights (their scales).
    """

    def open(self, files: list[Path]) -> None:
        """Called once with the checkpoint's files, before any tensor is read."""

    def is_weight(self, name: str) -> bool:
        return True

    def read(self, handle, name: str, source: CheckpointSlice | None) -> torch.Tensor:
        """The part of checkpoint tensor `name` that `source` names (all of it for None)."""
        if source is None:
            return handle.get_tensor(name)
        piece = handle.get_slice(name)  # reads only the slice from disk
        end = source.start + source.length
        return piece[source.start : end] if source.dim == 0 else piece[:, source.start : end]


def _is_ignorable(name: str, tie_word_embeddings: bool) -> bool:
    """Checkpoint tensors we do not need: RoPE buffers, and lm_head when it is tied."""
    return name.endswith("rotary_emb.inv_freq") or (
        tie_word_embeddings and name == "lm_head.weight"
    )


def load_weights(model: nn.Module, model_dir: Path, reader: WeightReader | None = None) -> None:
    """Copy every safetensors tensor of `model_dir` into `model`, one tensor at a time."""
    started = time.perf_counter()
    reader = reader or WeightReader()
    destinations = checkpoint_tensors(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    files = weight_files(Path(model_dir))
    reader.open(files)
    names_by_file: dict[Path, list[str]] = {}
    for file in files:  # headers only: check names before copying anything
        with safe_open(file, framework="pt", device="cpu") as f:
            names = f.keys()  # a safe_open handle is not iterable itself
        names_by_file[file] = [
            n for n in names if not _is_ignorable(n, tied) and reader.is_weight(n)
        ]
    found = {name for names in names_by_file.values() for name in names}
    missing = sorted(set(destinations) - found)
    unexpected = sorted(found - set(destinations))
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint {model_dir} does not match the model built from its config.json: "
            f"missing tensors {_preview(missing)}; unexpected tensors {_preview(unexpected)}"
        )

    with torch.no_grad():
        for shard_index, file in enumerate(files, start=1):
            logger.info(
                "loading weights: shard %d/%d (%s, %.1f MB)",
                shard_index,
                len(files),
                file.name,
                file.stat().st_size / 1e6,
            )
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names_by_file[file]:
                    destination, source = destinations[name]
                    tensor = reader.read(f, name, source)
                    if tensor.shape != destination.shape:
                        raise ModelLoadError(
                            f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"but config.json implies {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)  # casts to the model dtype, moves to its device
                    del tensor
    logger.info("loaded %d tensors in %.1f s", len(found), time.perf_counter() - started)


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
