"""The fused CPU RMSNorm, RoPE and SwiGLU kernels against the portable ops they replace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanoserve.core.layers.norm import RMSNorm
from nanoserve.core.layers.ops import PORTABLE_OPS, LayerOps, install_layer_ops
from nanoserve.core.layers.rotary import RotaryEmbedding
from nanoserve.core.models.llama import LlamaMLP
from nanoserve.core.parallel import TensorParallel
from nanoserve.platforms.cpu.fused_ops import FusedCpuOps
from nanoserve.platforms.cpu.kernels import load_cpu_kernels


@pytest.fixture(scope="module")
def fused() -> FusedCpuOps:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build"
    return FusedCpuOps(kernels)


@pytest.fixture
def toggle(fused):
    """Runs `fn(ops)` with the portable ops, then the fused ones; returns both results."""

    def run(fn):
        with torch.no_grad():
            return fn(PORTABLE_OPS), fn(fused)

    return run


def with_ops(module: torch.nn.Module, ops: LayerOps) -> torch.nn.Module:
    install_layer_ops(module, ops)
    return module


def assert_same(plain: torch.Tensor, fused: torch.Tensor) -> None:
    assert fused.shape == plain.shape and fused.dtype == plain.dtype
    if plain.dtype == torch.bfloat16:
        # The same roundings; only the order of the float32 sum of squares differs, which
        # now and then moves a value across a bf16 rounding boundary (one unit, then the weight).
        assert (fused != plain).float().mean() < 1e-3
        torch.testing.assert_close(fused, plain, rtol=2**-6, atol=0)  # twice rounded
    else:
        torch.testing.assert_close(fused, plain, rtol=2e-6, atol=1e-6)


# 1 token (a decode step: one thread) and 300 (a prefill: rows split across threads).
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_the_plain_ops(toggle, tokens, dtype):
    torch.manual_seed(tokens)
    norm = RMSNorm(1024, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(1024)).to(dtype)
    x = (4 * torch.randn(tokens, 1024)).to(dtype)  # [T, hidden]
    assert_same(*toggle(lambda ops: with_ops(norm, ops)(x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_head_normalization_of_a_strided_view_matches(toggle, dtype):
    torch.manual_seed(1)
    qkv = torch.randn(5, 40, 128).to(dtype)  # [T, H + 2 * Hkv, D]
    qk = qkv[:, :24]  # a view: rows contiguous, tokens 40 heads apart
    assert_same(*toggle(lambda ops: ops.rms_norm(qk, None, 1e-6)))
    heads = qkv.transpose(0, 1)[:, :3]  # [40, 3, 128]: neither outer dim contiguous
    assert_same(*toggle(lambda ops: ops.rms_norm(heads, None, 1e-6)))


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_matches_the_plain_ops(toggle, tokens, dtype):
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(128, 4096, 1_000_000.0)
    cos, signed_sin = rope(torch.randint(0, 4096, (tokens,)), dtype)  # [T, 1, D] each
    q = torch.randn(tokens, 24, 128).to(dtype)[:, 8:]  # [T, 16, D], a strided view
    plain, fused = toggle(lambda ops: ops.rotary(q, cos, signed_sin))
    assert torch.equal(fused, plain)  # two rounded products and their rounded sum, as torch


# 1 token, 300 (rows split across threads); 3075 intermediate values: a tail past 16 lanes.
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_the_plain_ops(toggle, tokens, dtype):
    torch.manual_seed(tokens)
    gate_up = (4 * torch.randn(tokens, 2 * 3075)).to(dtype)  # [T, 2I]: gate, then up
    plain, fused = toggle(lambda ops: ops.silu_mul(gate_up))  # [T, I]
    assert fused.shape == plain.shape and fused.dtype == plain.dtype
    if dtype == torch.bfloat16:  # silu rounded, then the product: PyTorch's two roundings
        assert (fused != plain).float().mean() < 1e-3
        torch.testing.assert_close(fused, plain, rtol=2**-7, atol=0)
    else:  # our exp is within about an ulp of PyTorch's
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)


def test_the_mlp_takes_the_fused_silu_mul(toggle):
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=64, intermediate_size=160)  # what the MLP reads
    mlp = LlamaMLP(config, TensorParallel()).to(torch.bfloat16)
    for parameter in mlp.parameters():
        parameter.data.normal_(0, 0.2)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    assert_same(*toggle(lambda ops: with_ops(mlp, ops)(x)))


def test_the_kernels_stay_out_of_other_dtypes_and_of_compiled_code(fused, monkeypatch):
    assert fused.takes(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not fused.takes(torch.zeros(2, 8, dtype=torch.float16))
    x = torch.randn(3, 8).half()
    assert torch.equal(fused.rms_norm(x, None, 1e-6), PORTABLE_OPS.rms_norm(x, None, 1e-6))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused.takes(torch.zeros(2, 8, dtype=torch.bfloat16))


def test_the_cpu_platform_installs_them_on_every_layer_that_calls_layer_ops(tmp_path):
    from tiny_checkpoints import make_tiny_checkpoint

    from nanoserve import LLM

    llm = LLM(str(make_tiny_checkpoint(tmp_path, "qwen3")), device="cpu")
    users = [m for m in llm.engine.model.modules() if isinstance(getattr(m, "ops", None), LayerOps)]
    assert users and all(isinstance(m.ops, FusedCpuOps) for m in users)
