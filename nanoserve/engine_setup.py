"""Builds an engine with the fast paths of this machine and these settings.

This is the one module that knows every plug-in: the platform's fast paths (`platforms/cpu`,
`platforms/cuda`), quantized linears (`quantization/`), structured output
(`structured_output/`), tensor parallelism (`distributed/`) and the mixture-of-experts models
and their methods (`moe/`). It picks them once, at
start-up, and hands them to the core through its plug points (`core/fast_paths.py`); the core
imports none of them. The offline `LLM`, the worker process and the tests build engines here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nanoserve.common.config import EngineConfig
from nanoserve.core.engine import Engine
from nanoserve.core.fast_paths import FastPaths
from nanoserve.core.grammar import GrammarBackend, NoGrammarBackend
from nanoserve.core.loader import resolve_device
from nanoserve.core.model_runner import StepRunner
from nanoserve.core.models.base import CausalLM
from nanoserve.core.parallel import TensorParallel
from nanoserve.core.sampler import SamplerOps
from nanoserve.core.speculation import Speculator
from nanoserve.distributed.step_broadcast import BroadcastingRunner, StepBroadcaster, follow
from nanoserve.moe.models import moe_model_classes
from nanoserve.moe.setup import install_moe_methods
from nanoserve.quantization import fp8
from nanoserve.quantization.int8 import install_int8_linears
from nanoserve.quantization.kv_cache_fp8 import with_kv_cache_dtype

if TYPE_CHECKING:
    from nanoserve.spec_decode.suffix import TrieKinds

logger = logging.getLogger("nanoserve.engine_setup")


def build_engine(config: EngineConfig, tp: TensorParallel | None = None) -> Engine:
    """An engine of `config` (this rank's, with `tp`) on its device, with every fast path."""
    tp = tp or TensorParallel()
    device = resolve_device(config.device)
    return Engine(config, tp, fast_paths_for(config, device, tp))


def fast_paths_for(config: EngineConfig, device: torch.device, tp: TensorParallel) -> FastPaths:
    """The platform's paths, with quantization before its linear methods, the KV cache's dtype
    (FP8: quantized on write), structured output, and on rank 0 of a tensor-parallel group the
    step broadcast."""
    # The platform's own tries for suffix decoding, if it has them (asked for only when
    # speculating; otherwise Python's).
    platform_suffix_tries: Callable[[], TrieKinds | None] | None = None
    if device.type == "cuda":
        from nanoserve.platforms.cuda.fast_paths import cuda_fast_paths

        paths = cuda_fast_paths(config, device)
    else:
        from nanoserve.platforms.cpu.fast_paths import cpu_fast_paths
        from nanoserve.platforms.cpu.suffix_tries import cpu_suffix_tries

        paths = cpu_fast_paths(config)
        platform_suffix_tries = cpu_suffix_tries
    platform_prepare = paths.prepare_model

    def prepare_model(model: CausalLM) -> None:
        quantize_linears(model, config, device)  # then the platform packs what is still plain
        install_moe_methods(model, config, device)
        platform_prepare(model)

    paths = dataclasses.replace(
        paths,
        prepare_model=prepare_model,
        weight_reader=fp8.weight_reader_for,
        grammar_backend=grammar_backend,
        model_classes=moe_model_classes(config.enable_expert_parallel),
    )
    paths = with_kv_cache_dtype(paths, config.kv_cache_dtype, config.calculate_kv_scales)
    if config.speculative_config is not None:
        tries = platform_suffix_tries() if platform_suffix_tries is not None else None
        speculator = speculator_for(config, paths.sampler_ops, tries)
        paths = dataclasses.replace(paths, speculator=speculator)
    if tp.size > 1 and tp.is_first:
        paths = with_step_broadcast(paths, StepBroadcaster(tp, device))
    return paths


def speculator_for(
    config: EngineConfig, sampler_ops: SamplerOps, suffix_tries: TrieKinds | None = None
) -> Callable[[torch.device, int, int], Speculator]:
    """Speculative decoding's speculator, built once the engine knows its vocabulary and
    max_model_len (the draft model's engine takes them); its rejection sampler takes the
    platform's `sampler_ops`, as the engine's sampler does, and suffix decoding the platform's
    `suffix_tries` where it has them."""

    def build(device: torch.device, vocab_size: int, max_model_len: int) -> Speculator:
        from nanoserve.spec_decode import build_speculator

        return build_speculator(
            config, device, vocab_size, max_model_len, sampler_ops, suffix_tries
        )

    return build


def quantize_linears(model: CausalLM, config: EngineConfig, device: torch.device) -> None:
    """int8 where asked (`--quantization int8`); FP8 products for an FP8 checkpoint on a GPU
    with FP8 units (elsewhere its weights were dequantized while loading)."""
    if config.quantization == "int8":
        kernels = None
        if device.type == "cpu":
            from nanoserve.platforms.cpu.kernels import load_cpu_kernels

            kernels = load_cpu_kernels()
        install_int8_linears(
            model,
            include_lm_head=config.quantize_lm_head,
            gemv=kernels.int8_gemv if kernels is not None else None,
            blocks=kernels.int8_gemv_blocks if kernels is not None else None,
        )
        return
    model_config = getattr(model, "config", None)
    is_fp8_checkpoint = model_config is not None and model_config.quantization is not None
    if is_fp8_checkpoint and fp8.can_use_fp8_matmul(device):
        fp8.install_fp8_linears(model)


def grammar_backend(tokenizer_dir: Path, vocab_size: int, eos: frozenset[int]) -> GrammarBackend:
    """llguidance's matchers and masks; where it is not installed, every constrained request
    is refused with the reason."""
    try:
        from nanoserve.structured_output.manager import StructuredOutputManager
    except ImportError as error:
        logger.warning("structured output is off: %s", error)
        return NoGrammarBackend(f"structured output is not available on this server ({error})")
    return StructuredOutputManager(tokenizer_dir, vocab_size, eos)


def with_step_broadcast(paths: FastPaths, broadcaster: StepBroadcaster) -> FastPaths:
    """Rank 0's paths: the same runners, each step sent to the other ranks first."""
    make_runners = paths.step_runners

    def step_runners(model: CausalLM, eager: StepRunner, limits) -> list[StepRunner]:
        return [BroadcastingRunner(make_runners(model, eager, limits), broadcaster)]

    return dataclasses.replace(paths, step_runners=step_runners)


def follow_rank_zero(engine: Engine) -> None:
    """A rank other than 0: run the steps rank 0 broadcasts until it stops."""
    follow(engine.runner, StepBroadcaster(engine.tp, engine.device))
