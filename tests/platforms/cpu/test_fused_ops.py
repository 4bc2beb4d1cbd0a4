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


# 1 token (a decode step: one thread) and 300 (a prefill: rows split across threads); a
# hidden size of 1027: a tail past the 8-lane vectors.
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [1024, 1027])
def test_rms_norm_matches_the_plain_ops(toggle, tokens, dtype, hidden):
    torch.manual_seed(tokens)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden)).to(dtype)
    x = (4 * torch.randn(tokens, hidden)).to(dtype)  # [T, hidden]
    assert_same(*toggle(lambda ops: with_ops(norm, ops)(x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_head_normalization_of_a_strided_view_matches(toggle, dtype):
    torch.manual_seed(1)
    qkv = torch.randn(5, 40, 128).to(dtype)  # [T, H + 2 * Hkv, D]
    qk = qkv[:, :24]  # a view: rows contiguous, tokens 40 heads apart
    assert_same(*toggle(lambda ops: ops.rms_norm(qk, None, 1e-6)))
    heads = qkv.transpose(0, 1)[:, :3]  # [40, 3, 128]: neither outer dim contiguous
    assert_same(*toggle(lambda ops: ops.rms_norm(heads, None, 1e-6)))


# head_dim 20: each half 8 lanes and a tail of 2.
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [128, 20])
def test_rotary_matches_the_plain_ops(toggle, tokens, dtype, head_dim):
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0)
    cos, signed_sin = rope(torch.randint(0, 4096, (tokens,)), dtype)  # [T, 1, D] each
    q = torch.randn(tokens, 24, head_dim).to(dtype)[:, 8:]  # [T, 16, D], a strided view
    plain, fused = toggle(lambda ops: ops.rotary(q, cos, signed_sin))
    assert torch.equal(fused, plain)  # two rounded products and their rounded sum, as torch


# 1 token (one thread), 40 (split across threads: rows this wide split past ~21), 300;
# 3075 intermediate values: a tail past 16 lanes.
@pytest.mark.parametrize("tokens", [1, 40, 300])
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


def test_silu_mul_rounds_ties_to_even_and_keeps_nan_and_overflow_as_the_plain_ops(toggle):
    """bf16 roundings of the vector lanes (16 on AVX-512, 8 on AVX2) and the scalar tail: for
    gates of 24 and more silu(g) = g exactly, so the product is a bf16 product, exact in
    float32, and some land halfway between two bf16 values."""
    nan, big = float("nan"), 3e38
    gate = [24.0, 24.0, 24.0, 24.0, nan, big, -big, 1e-39, -100.0, 0.5, -0.5]
    up = [1.0234375, 1.0078125, 1.0546875, 1.0390625, 1.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0]
    expected = [24.5, 24.25, 25.25, 25.0, nan, float("inf")]  # ties: to the even neighbour
    # Copies at 0 and 11 (vector lanes) and 24: the tail of 30 values after 3 AVX2 vectors
    # or one AVX-512 vector.
    gates, ups = gate * 2 + [1.0, 1.0] + gate[:6], up * 2 + [1.0, 1.0] + up[:6]
    gate_up = torch.tensor([gates + ups], dtype=torch.bfloat16)  # [1, 2 * 30]
    assert gate_up[0, 30] * gate_up[0, 0] == 24.5625  # the first product: a tie
    plain, fused = toggle(lambda ops: ops.silu_mul(gate_up))  # [1, 30]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0, equal_nan=True)
    for start in (0, 11, 24):
        got = fused[0, start : start + len(expected)].float()
        torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("special", [None, float("nan"), 1e-39])
def test_a_vectors_ties_round_to_even_with_or_without_a_nan_or_subnormal_lane(toggle, special):
    """Whole 16-lane vectors of ties (silu(24) = 24 exactly, so the product is exact in float32
    and halfway between two bf16 values): rounded by the CPU's conversion where no lane is a
    NaN or a subnormal, by PyTorch's own rounding where one is; the same bits either way."""
    ups = [1.0234375, 1.0078125, 1.0546875, 1.0390625] * 8  # [32]: two vectors' worth
    gates = [24.0] * 32
    if special is not None:
        gates[21] = special  # in the second vector only
    gate_up = torch.tensor([gates + ups], dtype=torch.bfloat16)  # [1, 2 * 32]
    plain, fused = toggle(lambda ops: ops.silu_mul(gate_up))  # [1, 32]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0, equal_nan=True)
    ties = torch.tensor([24.5, 24.25, 25.25, 25.0] * 4)
    assert torch.equal(fused[0, :16].float(), ties)  # to the even neighbour


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


@pytest.mark.parametrize("tokens", [1, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_residual_add_and_its_norm_in_one_pass_round_as_the_two_kernels(fused, tokens, dtype):
    """The fused decode step's `add_rms_norm`: exactly `x + delta`, then `rms_norm` of it."""
    kernels = fused.kernels
    generator = torch.Generator().manual_seed(tokens)
    x, delta = (torch.randn(tokens, 1024, generator=generator).to(dtype) * 4 for _ in range(2))
    weight = torch.randn(1024, generator=generator).to(dtype)
    total, normed = kernels.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, kernels.rms_norm(x + delta, weight, 1e-6))


@pytest.mark.parametrize("tokens", [1, 70])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norms", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])  # bf16 64/128/256: held in registers
def test_q_k_norms_and_rope_in_one_pass_round_as_the_kernels_one_by_one(
    fused, tokens, dtype, with_norms, head_dim
):
    """The fused decode step's `qk_norm_rotary` on q and k heads of a fused qkv product (a
    strided view), against rms_norm, the scales' products and rotary called one by one."""
    kernels = fused.kernels
    heads, kv_heads = 16, 8
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    cos, sin = (torch.randn(tokens, 1, head_dim, generator=generator).to(dtype) for _ in "cs")
    q_weight, k_weight = (torch.randn(head_dim, generator=generator).to(dtype) for _ in "qk")
    weights = (q_weight, k_weight) if with_norms else (None, None)
    q, k = kernels.qk_norm_rotary(qk, heads, *weights, cos, sin, 1e-6)
    expected = qk
    if with_norms:
        normed = kernels.rms_norm(qk, None, 1e-6)
        expected = torch.cat([q_weight * normed[:, :heads], k_weight * normed[:, heads:]], dim=1)
    assert torch.equal(q, kernels.rotary(expected[:, :heads], cos, sin))
    assert torch.equal(k, kernels.rotary(expected[:, heads:], cos, sin))
    assert q.is_contiguous() and k.is_contiguous()


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norms", [True, False], ids=["qwen3", "llama"])
def test_the_attentions_q_k_norms_and_rope_match_the_plain_ops(toggle, tokens, dtype, with_norms):
    """The layer op the attention calls (`qk_norm_rotary`) on a strided view of a qkv product:
    through the kernel, the plain ops' results (the kernel's sum of squares aside)."""
    heads, kv_heads, head_dim = 16, 8, 128
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)(torch.arange(tokens) * 7, dtype)
    norms = (RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)) if with_norms else None
    for norm in norms or ():
        norm.weight.data = torch.randn(head_dim).to(dtype)
    plain, fused = toggle(lambda ops: ops.qk_norm_rotary(qk, heads, norms, *rope))
    for plain_part, fused_part in zip(plain, fused, strict=True):
        assert fused_part.shape == plain_part.shape and fused_part.dtype == dtype
        if dtype == torch.bfloat16 and with_norms:
            # A normed value one bf16 unit apart (the sum of squares' order) moves its rotated
            # output by a unit of the larger of the two products it is the sum of.
            assert (fused_part != plain_part).float().mean() < 2e-3
            torch.testing.assert_close(fused_part, plain_part, rtol=2**-6, atol=2**-5)
        else:
            assert_same(plain_part, fused_part)


def test_q_k_heads_the_kernel_cannot_take_go_op_by_op(fused, monkeypatch):
    calls: list[int] = []
    real = fused.kernels.qk_norm_rotary
    monkeypatch.setattr(fused.kernels, "qk_norm_rotary", lambda *a: calls.append(1) or real(*a))
    qk = torch.randn(5, 6, 20, dtype=torch.bfloat16)
    rope = RotaryEmbedding(20, 64, 10000.0)(torch.arange(5), torch.bfloat16)
    norms = (RMSNorm(20, 1e-6), RMSNorm(20, 1e-6))  # float32 weights beside bf16 heads
    q, k = fused.qk_norm_rotary(qk, 4, norms, *rope)
    expected = LayerOps.qk_norm_rotary(fused, qk, 4, norms, *rope)  # norm, scale, rotate
    assert calls == [] and torch.equal(q, expected[0]) and torch.equal(k, expected[1])
    fused.qk_norm_rotary(qk.transpose(0, 1).contiguous().transpose(0, 1), 4, None, *rope)
    assert calls == []  # heads not contiguous within a token
    fused.qk_norm_rotary(qk, 4, None, *rope)
    assert calls == [1]
