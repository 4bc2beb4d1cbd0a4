"""The block decode product (csrc/block_gemv.cpp): a few tokens times a bf16 weight laid out in
blocks of 64 rows, float32 sums rounded once, and bf16_gemv_weight's choice of that layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.common.cpu_features import has_amx_bf16, has_avx512_bf16

CPU_HAS_BF16 = has_avx512_bf16()
needs_bf16 = pytest.mark.skipif(not CPU_HAS_BF16, reason="this CPU has no AVX-512 BF16")


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16)


def test_the_blocks_hold_each_k_pair_of_64_rows_side_by_side(kernels):
    weight = bf16(128, 6)
    blocks = kernels.bf16_blocks(weight)  # [N/64, K/2, 64, 2]
    assert blocks.shape == (2, 3, 64, 2) and blocks.is_contiguous()
    for n, k in [(0, 0), (5, 1), (63, 4), (64, 5), (127, 2)]:
        assert blocks[n // 64, k // 2, n % 64, k % 2] == weight[n, k]
    for refused in (bf16(96, 6), bf16(64, 7), torch.randn(64, 6)):  # rows, odd k, float32
        with pytest.raises(RuntimeError, match="bf16_blocks takes"):
            kernels.bf16_blocks(refused)


def test_the_gemv_weight_is_in_blocks_wherever_the_block_product_is_the_fastest_here(kernels):
    """AVX-512 BF16 without AMX: blocks; AMX: its tiles' own layout (amx_gemv.cpp)."""
    weight = bf16(128, 64)
    expected_blocks = CPU_HAS_BF16 and not has_amx_bf16()
    assert kernels.block_gemv_takes(weight) == expected_blocks
    laid_out = kernels.bf16_gemv_weight(weight)
    assert laid_out.dim() == (4 if expected_blocks else 5 if has_amx_bf16() else 2)
    assert kernels.bf16_gemv_weight(bf16(100, 64)).dim() == 2  # no whole blocks: plain


@needs_bf16
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 2), (128, 96), (4096, 1024)])
@pytest.mark.parametrize("rows", [*range(1, 10), 16])  # past 8: two passes over the blocks
def test_it_is_the_float32_product_rounded_once(kernels, out_features, in_features, rows):
    torch.manual_seed(rows)
    weight, x = bf16(out_features, in_features), bf16(rows, in_features)
    out = kernels.bf16_gemv(x, kernels.bf16_blocks(weight))  # [rows, out]
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    expected = x.float() @ weight.float().T  # bf16 products are exact in float32
    torch.testing.assert_close(out.float(), expected, atol=1e-4, rtol=2**-8)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=2**-7)


@needs_bf16
def test_a_nan_or_an_infinity_reaches_its_tokens_outputs_only(kernels):
    weight, x = bf16(64, 64), bf16(3, 64)
    x[0, 5], x[2, 9] = float("nan"), float("inf")
    out = kernels.bf16_gemv(x, kernels.bf16_blocks(weight)).float()
    assert out[0].isnan().all() and out[1].isfinite().all()
    expected = x.float() @ weight.float().T  # +-inf, or NaN where a weight is 0
    assert torch.equal(out[2].isinf(), expected[2].isinf())


@needs_bf16
def test_strided_tokens_and_any_thread_count_give_the_same_outputs(kernels):
    blocks = kernels.bf16_blocks(bf16(64 * 5, 256))  # five blocks: two threads take two and three
    x = bf16(4, 512)[:, ::2]  # not contiguous
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.bf16_gemv(x.contiguous(), blocks)
        torch.set_num_threads(2)
        two = kernels.bf16_gemv(x, blocks)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one thread's sum, in the same order


@needs_bf16
def test_it_refuses_what_it_does_not_multiply(kernels):
    blocks = kernels.bf16_blocks(bf16(64, 32))
    with pytest.raises(RuntimeError, match="1 to 80 rows"):
        kernels.bf16_gemv(bf16(81, 32), blocks)
    with pytest.raises(RuntimeError):
        kernels.bf16_gemv(bf16(2, 30), blocks)  # k differs
    with pytest.raises(RuntimeError):
        kernels.bf16_gemv(torch.randn(2, 32), blocks)  # float32 activations
    with pytest.raises(RuntimeError, match="as bf16_gemv_weight lays it out"):
        kernels.bf16_gemv(bf16(2, 32), blocks.view(1, 16, 32, 4))
