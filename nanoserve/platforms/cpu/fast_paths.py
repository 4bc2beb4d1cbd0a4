"""What the CPU puts into the core, chosen once for an engine on this machine.

    linear methods   bf16 weights packed once for oneDNN, decode steps by our GEMV (`linear.py`)
    layer ops        fused RMSNorm, RoPE and SwiGLU kernels (`fused_ops.py`)
    sampler ops      a step's argmax and random draws, one vector pass a row (`sampler_ops.py`)
    attention        the reference backend with our paged-decode kernel (`attention.py`)
    KV pool memory   zeros the OS hands out as pages are first written, faulted in ahead of
                     use while the worker is idle (`memory.py`)
    step runners     decode steps of a few tokens through every layer in one C++ call
                     (`fused_decode.py`), or with `--compile` under torch.compile
                     (`compiled.py`); every step at the thread count its timing picks
                     (`threads.py`)

Each needs the C++ kernels (`kernels.py`) but the packing and the thread count: without them (no
compiler, or NANOSERVE_CPU_KERNELS=0) the portable ops and the reference backend run.
`--enforce-eager` turns the fused and compiled decode steps off. The thread count adapts unless
NANOSERVE_ADAPTIVE_THREADS=0 or `--compile` (inductor fixes its kernels' count when it compiles
them): the worker's count (OMP_NUM_THREADS, or the front's choice) is then the most it uses.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from nanoserve.common.config import EngineConfig, SchedulerConfig
from nanoserve.core.attention.layer import AttentionBackend
from nanoserve.core.attention.reference import ReferenceAttention
from nanoserve.core.fast_paths import FastPaths
from nanoserve.core.layers.ops import install_layer_ops
from nanoserve.core.model_runner import EagerStepRunner, StepRunner
from nanoserve.core.models.base import CausalLM
from nanoserve.core.sampler import SamplerOps
from nanoserve.platforms.cpu.attention import CpuKernelAttention
from nanoserve.platforms.cpu.compiled import CompiledCpuAttention, CompiledDecodeRunner
from nanoserve.platforms.cpu.fused_decode import fused_decode_runner
from nanoserve.platforms.cpu.fused_ops import FusedCpuOps
from nanoserve.platforms.cpu.kernels import load_cpu_kernels
from nanoserve.platforms.cpu.linear import install_cpu_linears
from nanoserve.platforms.cpu.memory import KVPoolPages
from nanoserve.platforms.cpu.sampler_ops import CpuSamplerOps
from nanoserve.platforms.cpu.threads import GovernedRunner, ThreadGovernor
from nanoserve.platforms.cpu.tied_embedding import read_tied_embedding_from_gemv_layout


class CpuPaths:
    """The CPU's fast paths for one engine (the kernels, if built, and the settings)."""

    def __init__(self, config: EngineConfig, kernels: ModuleType | None) -> None:
        self.kernels = kernels
        self.compiled = config.use_compiled_decode
        self.fused = kernels is not None and not config.enforce_eager and not self.compiled
        self.pool_pages = KVPoolPages()
        self.sampler_ops = SamplerOps() if kernels is None else CpuSamplerOps(kernels)

    def prepare_model(self, model: CausalLM) -> None:
        """Packed weights for the linears still plain (after any quantization), fused ops."""
        # The compiled one-token products stream the plain weights: keep them too.
        install_cpu_linears(model, keep_plain_weights=self.compiled)
        read_tied_embedding_from_gemv_layout(model)  # two copies of a tied matrix, not three
        if self.kernels is not None:
            install_layer_ops(model, FusedCpuOps(self.kernels))

    def attention_backend(self, model: CausalLM) -> AttentionBackend:
        if self.compiled:
            return CompiledCpuAttention()
        return ReferenceAttention() if self.kernels is None else CpuKernelAttention(self.kernels)

    def step_runners(
        self, model: CausalLM, eager: StepRunner, limits: SchedulerConfig
    ) -> list[StepRunner]:
        runners = [eager]
        if self.compiled:
            assert isinstance(eager, EagerStepRunner)
            compiled = CompiledDecodeRunner(eager)
            compiled.compile_graphs()
            runners = [compiled, eager]
        fused = None
        if self.fused and self.kernels is not None:
            fused = fused_decode_runner(eager, self.kernels)
        if fused is not None:
            runners = [fused, eager]
        max_threads = torch.get_num_threads()
        is_off = os.environ.get("NANOSERVE_ADAPTIVE_THREADS", "1") == "0"
        if max_threads == 1 or is_off or self.compiled:  # compiled kernels fix their count
            return runners
        return [GovernedRunner(runners, ThreadGovernor(max_threads))]


def cpu_fast_paths(config: EngineConfig) -> FastPaths:
    """The CPU's fast paths for an engine of `config`."""
    paths = CpuPaths(config, load_cpu_kernels())
    return FastPaths(
        prepare_model=paths.prepare_model,
        attention_backend=paths.attention_backend,
        kv_cache_zeros=paths.pool_pages.zeros,
        idle_work=paths.pool_pages.fault_in,
        step_runners=paths.step_runners,
        sampler_ops=paths.sampler_ops,
    )
