"""The core's plug points, and the portable default behind each.

Every fast path enters the core through one of these, chosen once at start-up outside the core
(`nanoserve/engine_setup.py` picks them for the machine and the settings): the core never asks
which device it runs on, and with the defaults it runs alone, on CPU or CUDA, as the reference
every fast path is tested against (`--enforce-eager` keeps as much of it as the device allows).

    prepare_model      linear methods (`layers/linear.py`) and layer ops (`layers/ops.py`),
                       installed layer by layer on the loaded model: int8, FP8, packed, fused
    weight_reader      how checkpoint tensors are read (`loader.py`): FP8 checkpoints dequantize
    attention_backend  how attention writes and reads the paged cache (`attention/layer.py`)
    kv_cache_budget    how many bytes the KV pool may take (`kv_cache.py`)
    kv_cache_zeros     how the KV pool's zeros are allocated (`kv_cache.py`)
    idle_work          what the worker does while nothing runs (`worker/loop.py`)
    step_runners       how a step's forward pass is launched (`model_runner.py`): CUDA graphs,
                       compiled decode, tensor-parallel broadcast, then the eager runner
    grammar_backend    structured output (`grammar.py`)
    sampler_ops        the sampler's passes over whole rows: argmax, a draw (`sampler.py`)
    speculator         speculative decoding: drafts proposed and verified (`speculation.py`)
    model_classes      architectures beyond the core's (`models/registry.py`): MoE models
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanoserve.common.config import CacheConfig, ModelConfig, SchedulerConfig
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.attention.reference import ReferenceAttention
from nanoserve.core.grammar import GrammarBackend, NoGrammarBackend
from nanoserve.core.kv_cache import KVCache, Zeros, portable_zeros
from nanoserve.core.loader import WeightReader
from nanoserve.core.model_runner import StepRunner
from nanoserve.core.models.base import CausalLM
from nanoserve.core.sampler import SamplerOps
from nanoserve.core.speculation import Speculator


@dataclass
class FastPaths:
    """What a platform or a plug-in puts into the core; each default is the portable path."""

    prepare_model: Callable[[CausalLM], None] = lambda model: None  # F.linear, portable ops
    weight_reader: Callable[[ModelConfig], WeightReader] = lambda config: WeightReader()
    attention_backend: Callable[[CausalLM], AttentionBackend] = lambda model: ReferenceAttention()
    # Bytes for the KV pool, measured with the loaded model and the unallocated cache; None:
    # `kv_cache_memory`, else up to 2 GiB (`kv_cache.py`).
    kv_cache_budget: Callable[[CausalLM, KVCache, CacheConfig, SchedulerConfig], int] | None = None
    kv_cache_zeros: Zeros = portable_zeros  # the pool's memory, zeroed
    # A short slice of background work while no request runs; True while more remains (on
    # CPU: the KV pool's pages faulted in ahead of use). By default, none.
    idle_work: Callable[[], bool] = lambda: False
    # The runners a step may take, in order of preference, given the eager one (last resort).
    step_runners: Callable[[CausalLM, StepRunner, SchedulerConfig], list[StepRunner]] = (
        lambda model, eager, limits: [eager]
    )
    # Builds the grammars of constrained requests (tokenizer dir, vocab size, EOS ids); by
    # default every constrained request is refused, saying so.
    grammar_backend: Callable[[Path, int, frozenset[int]], GrammarBackend] = (
        lambda tokenizer_dir, vocab_size, eos: NoGrammarBackend()
    )
    sampler_ops: SamplerOps = field(default_factory=SamplerOps)
    # Drafts tokens and verifies them (device, vocab size, max_model_len); by default, none.
    speculator: Callable[[torch.device, int, int], Speculator] = (
        lambda device, vocab_size, max_model_len: Speculator()
    )
    model_classes: dict[str, Callable[..., CausalLM]] = field(default_factory=dict)  # MoE
