"""Which model class serves an `architectures` name: Llama's family (one class with switches
from ModelConfig: Llama, Mistral, Qwen2, Qwen3) or a plug-in's (`FastPaths.model_classes`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from nanoserve.common.checkpoint import DENSE_ARCHITECTURES
from nanoserve.core.models.base import CausalLM
from nanoserve.core.models.llama import LlamaForCausalLM

ModelClass = Callable[..., CausalLM]  # (ModelConfig, TensorParallel | None) -> a model
MODEL_REGISTRY: dict[str, ModelClass] = dict.fromkeys(DENSE_ARCHITECTURES, LlamaForCausalLM)


def get_model_class(architecture: str, extra: Mapping[str, ModelClass] | None = None) -> ModelClass:
    """The class for `architecture`, the core's or `extra`'s; ValueError naming all otherwise."""
    registry = {**MODEL_REGISTRY, **(extra or {})}
    try:
        return registry[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(registry)}"
        ) from None
