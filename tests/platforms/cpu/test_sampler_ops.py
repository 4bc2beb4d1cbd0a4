"""The sampler's kernels (argmax, inverse-transform draws) against the portable `SamplerOps`,
and how the CPU platform plugs them in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.sampler import SamplerOps
from nanoserve.engine_setup import build_engine
from nanoserve.platforms.cpu.fast_paths import CpuPaths
from nanoserve.platforms.cpu.sampler_ops import CpuSamplerOps

NAN, INF = float("nan"), float("inf")
PORTABLE = SamplerOps()
SHAPES = [(1, 1), (3, 15), (2, 16), (4, 17), (5, 1000), (25, 4096), (3, 151936)]


@pytest.mark.parametrize("shape", SHAPES)
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


@pytest.mark.parametrize("shape", SHAPES)
def test_draws_take_the_tokens_the_portable_float64_sums_take(kernels, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    probs = (3 * torch.randn(*shape, generator=generator)).softmax(dim=-1)
    probs[:, ::3] = 0.0  # filtered tokens (top-k, top-p) are zeros
    probs[:, -1] += 1e-3  # no row all zeros
    for _ in range(20):
        uniforms = torch.rand(shape[0], dtype=torch.float64, generator=generator)
        drawn = kernels.draw_rows(probs, uniforms)
        assert torch.equal(drawn, PORTABLE.draw(probs, uniforms))
        assert (probs.gather(1, drawn.unsqueeze(1)) > 0).all()


def test_draws_at_the_ends_of_the_unit_interval_and_across_blocks(kernels):
    probs = torch.zeros(4, 1000)
    probs[:, [3, 255, 256, 600, 997]] = torch.tensor([0.125, 0.25, 0.375, 0.125, 0.125])
    uniforms = torch.tensor([0.0, 0.375 - 1e-9, 0.375 + 1e-9, 1 - 2**-53], dtype=torch.float64)
    assert kernels.draw_rows(probs, uniforms).tolist() == [3, 255, 256, 997]
    unnormalised = probs * 7.5  # a rejection sampler's residual: p without a token, not rescaled
    assert kernels.draw_rows(unnormalised, uniforms).tolist() == [3, 255, 256, 997]


def test_draws_follow_the_distribution(kernels):
    num_draws, vocab = 20000, 700  # blocks of 256: the draw crosses three
    probs = torch.zeros(vocab)
    probs[[0, 100, 255, 256, 500, 699]] = torch.tensor([0.05, 0.2, 0.1, 0.3, 0.15, 0.2])
    uniforms = torch.rand(
        num_draws, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    drawn = kernels.draw_rows(probs.expand(num_draws, vocab), uniforms)
    counts = torch.bincount(drawn, minlength=vocab).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept].double() * num_draws
    assert ((counts[kept] - expected) ** 2 / expected).sum() < 25.0  # df 5: p ~ 1e-4 by chance


def test_rows_apart_in_memory_are_read_where_they_lie(kernels):
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))[:, 10:250]
    assert x.stride(0) == 300
    assert torch.equal(kernels.row_argmax(x), x.max(dim=-1).indices)
    uniforms = torch.rand(6, dtype=torch.float64)
    probs = torch.rand(6, 300, generator=torch.Generator().manual_seed(2))[:, 10:250]
    assert torch.equal(kernels.draw_rows(probs, uniforms), PORTABLE.draw(probs, uniforms))


def test_the_kernels_refuse_what_they_cannot_read(kernels):
    with pytest.raises(RuntimeError, match="float32"):
        kernels.row_argmax(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.row_argmax(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="float64"):
        kernels.draw_rows(torch.rand(2, 8), torch.rand(2))
    with pytest.raises(RuntimeError, match="one float64 uniform per row"):
        kernels.draw_rows(torch.rand(2, 8), torch.rand(3, dtype=torch.float64))


class CountingKernels(SimpleNamespace):
    """Kernels that count their calls (and answer as the real ones)."""

    def __init__(self, kernels) -> None:
        super().__init__(calls=0, real=kernels)

    def row_argmax(self, x):
        self.calls += 1
        return self.real.row_argmax(x)

    def draw_rows(self, probs, uniforms):
        self.calls += 1
        return self.real.draw_rows(probs, uniforms)

    def sampling_is_vectorized(self):
        return True


def test_float32_rows_go_to_the_kernels_and_the_rest_to_the_portable_ops(kernels):
    counting = CountingKernels(kernels)
    ops = CpuSamplerOps(counting)  # type: ignore[arg-type]
    x = torch.randn(4, 100)
    uniforms = torch.rand(4, dtype=torch.float64)
    assert torch.equal(ops.argmax(x), PORTABLE.argmax(x))
    assert torch.equal(ops.draw(x.softmax(-1), uniforms), PORTABLE.draw(x.softmax(-1), uniforms))
    assert counting.calls == 2
    for other in (x.bfloat16(), x.t(), torch.randn(3, 4, 5)):
        assert torch.equal(ops.argmax(other), PORTABLE.argmax(other))
    columns = torch.rand(4, 100).t()  # rows not contiguous
    uniforms = torch.rand(100, dtype=torch.float64)
    assert torch.equal(ops.draw(columns, uniforms), PORTABLE.draw(columns, uniforms))
    assert torch.equal(
        ops.draw(x.softmax(-1), uniforms[:4].float()),
        PORTABLE.draw(x.softmax(-1), uniforms[:4].float()),
    )
    assert counting.calls == 2


def test_the_engine_and_its_rejection_sampler_take_the_cpu_ops(kernels, tmp_path):
    assert isinstance(CpuPaths(EngineConfig(model="unused"), kernels).sampler_ops, CpuSamplerOps)
    assert type(CpuPaths(EngineConfig(model="unused"), None).sampler_ops) is SamplerOps
    checkpoint = make_tiny_checkpoint(tmp_path)
    speculative = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    config = EngineConfig(
        model=str(checkpoint), device="cpu", max_model_len=64, speculative_config=speculative
    )
    engine = build_engine(config)
    assert isinstance(engine.runner.sampler.ops, CpuSamplerOps)
    assert engine.speculator.rejection_sampler.sampler.ops is engine.runner.sampler.ops
