"""The sampler's argmax kernel against PyTorch's `max(dim=-1).indices`, and how it is plugged in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.sampler import row_argmax
from nanoserve.engine_setup import build_engine
from nanoserve.platforms.cpu.fast_paths import CpuPaths

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 15), (2, 16), (4, 17), (5, 1000), (25, 4096), (3, 151936)]
)
def test_random_rows_give_torch_indices(kernels, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=generator)
    assert torch.equal(kernels.row_argmax(x), x.max(dim=-1).indices)


def test_ties_nans_and_infinities_resolve_as_torch_does(kernels):
    x = torch.randn(9, 1000, generator=torch.Generator().manual_seed(0))
    x[0, 30] = x[0, 600] = NAN  # the first NaN wins over every number
    x[1, 999] = NAN  # in the last, partial vector
    x[2] = -INF  # nothing above -inf: the first index
    x[3, 5] = x[3, 700] = INF
    x[4] = 1.0  # every value the same
    x[5, 17] = x[5, 33] = x[5].max() + 1  # a tie in two lanes
    x[6] = NAN
    x[7, 16] = x[7, 0] = x[7].max() + 1  # a tie in one lane
    x[8, 1:] = -INF
    x[8, 0] = NAN
    assert torch.equal(kernels.row_argmax(x), x.max(dim=-1).indices)


def test_rows_apart_in_memory_are_read_where_they_lie(kernels):
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))[:, 10:250]
    assert x.stride(0) == 300
    assert torch.equal(kernels.row_argmax(x), x.max(dim=-1).indices)


def test_the_kernel_refuses_what_it_cannot_read(kernels):
    with pytest.raises(RuntimeError, match="float32"):
        kernels.row_argmax(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.row_argmax(torch.randn(8, 2).t())


class CountingKernels(SimpleNamespace):
    """Kernels whose argmax counts its calls (and answers as the real one)."""

    def __init__(self, kernels) -> None:
        super().__init__(calls=0, real=kernels)

    def row_argmax(self, x):
        self.calls += 1
        return self.real.row_argmax(x)

    def row_argmax_is_vectorized(self):
        return True


def test_the_cpu_paths_take_float32_rows_to_the_kernel_and_the_rest_to_torch(kernels):
    counting = CountingKernels(kernels)
    paths = CpuPaths(EngineConfig(model="unused"), counting)  # type: ignore[arg-type]
    x = torch.randn(4, 100)
    assert torch.equal(paths.row_argmax(x), row_argmax(x)) and counting.calls == 1
    for other in (x.bfloat16(), x.t(), torch.randn(3, 4, 5), torch.randn(2, 0)[:, :0]):
        if other.numel():
            assert torch.equal(paths.row_argmax(other), row_argmax(other))
    assert counting.calls == 1
    assert (
        CpuPaths(EngineConfig(model="unused"), None).row_argmax(x).tolist()
        == row_argmax(x).tolist()
    )


def test_the_engine_and_its_rejection_sampler_find_maxima_with_the_cpu_paths(kernels, tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path)
    speculative = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    config = EngineConfig(
        model=str(checkpoint), device="cpu", max_model_len=64, speculative_config=speculative
    )
    engine = build_engine(config)
    argmax = engine.runner.sampler.argmax
    assert getattr(argmax, "__self__", None).__class__ is CpuPaths
    assert engine.speculator.rejection_sampler.sampler.argmax == argmax
