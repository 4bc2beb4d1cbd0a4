"""nanoserve: a small, readable LLM inference server.

`LLM` and `SamplingParams` are imported lazily so that the HTTP front process, which never
touches tensors, does not pay for importing torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanoserve.common.sampling_params import SamplingParams

        return SamplingParams
    if name in ("CompletionOutput", "RequestOutput"):
        from nanoserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
