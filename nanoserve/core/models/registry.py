"""Which model class serves which `architectures` name from a checkpoint's config.json."""

from __future__ import annotations

from nanoserve.common.checkpoint import SUPPORTED_ARCHITECTURES
from nanoserve.core.models.base import CausalLM
from nanoserve.core.models.llama import LlamaForCausalLM

# Llama, Mistral, Qwen2 and Qwen3 differ only in switches that ModelConfig carries.
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The model class for `architecture`; ValueError naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
