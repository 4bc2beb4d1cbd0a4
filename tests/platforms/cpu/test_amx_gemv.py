"""The AMX product of a few tokens (csrc/amx_gemv.cpp): up to 80 tokens times a bf16 weight
laid out in AMX's tiles, float32 sums rounded once, and bf16_gemv's route to it where it
applies."""

from __future__ import annotations

import pytest
import torch

from nanoserve.common.cpu_features import has_amx_bf16

CPU_HAS_AMX = has_amx_bf16()
needs_amx = pytest.mark.skipif(not CPU_HAS_AMX, reason="this CPU has no AMX (bf16 tiles)")


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16)


def tiles(kernels, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [out, in] bf16 weight, and the same in AMX's tiles."""
    weight = bf16(out_features, in_features)
    return weight, kernels.amx_gemv_layout(weight)


def test_the_tiles_take_whole_tiles_wherever_the_cpu_has_amx(kernels):
    assert kernels.amx_gemv_takes(bf16(4096, 1024)) == CPU_HAS_AMX
    assert not kernels.amx_gemv_takes(bf16(37, 1024))  # rows: not 16s
    assert not kernels.amx_gemv_takes(bf16(64, 1000))  # k: not 32s
    assert kernels.bf16_gemv_max_rows() == (80 if CPU_HAS_AMX else 16)
    if not CPU_HAS_AMX:
        with pytest.raises(RuntimeError, match="no AMX here"):
            kernels.amx_gemv_layout(bf16(64, 64))


@needs_amx
def test_the_layout_holds_each_tile_in_pair_order_one_after_another(kernels):
    weight = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).bfloat16()
    laid_out = kernels.amx_gemv_layout(weight)  # [2 blocks, 2 k tiles, 16 pairs, 16 rows, 2]
    assert laid_out.shape == (2, 2, 16, 16, 2) and laid_out.is_contiguous()
    for block, k_tile, pair, row, half in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (0, 1, 3, 7, 1)]:
        expected = weight[16 * block + row, 32 * k_tile + 2 * pair + half]
        assert laid_out[block, k_tile, pair, row, half] == expected
    assert kernels.bf16_gemv_weight(weight).shape == laid_out.shape  # the GEMV's own copy
    assert kernels.amx_gemv_applies(bf16(80, 64), laid_out)
    assert not kernels.amx_gemv_applies(bf16(81, 64), laid_out)  # > 80 tokens
    assert not kernels.amx_gemv_applies(bf16(8, 64), weight)  # the plain weight


@needs_amx
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (80, 1024), (1024, 3072)])
# 17-80: two to five groups of 16 tokens, the last one partial or whole.
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 48, 63, 64, 65, 79, 80])
def test_it_is_the_float32_product_rounded_once(kernels, out_features, in_features, rows):
    torch.manual_seed(rows)
    (weight, laid_out), x = tiles(kernels, out_features, in_features), bf16(rows, in_features)
    out = kernels.amx_bf16_gemv(x, laid_out)  # [rows, out_features]
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    expected = x.float() @ weight.float().T  # bf16 products are exact in float32
    torch.testing.assert_close(out.float(), expected, atol=1e-4, rtol=2**-8)
    assert torch.equal(kernels.amx_bf16_gemv(x, laid_out, 4096), out)  # prefetching alike


@needs_amx
@pytest.mark.parametrize("rows", [8, 16, 40, 80])  # one pass on the tiles, not vector passes
def test_bf16_gemv_multiplies_whole_tiles_there(kernels, rows):
    (weight, laid_out), x = tiles(kernels, 4096, 1024), bf16(rows, 1024)
    out = kernels.bf16_gemv(x, laid_out)
    assert torch.equal(out, kernels.amx_bf16_gemv(x, laid_out, kernels.gemv_prefetch()))
    plain = kernels.bf16_gemv(x, weight)  # the plain weight: vector passes, sums in another order
    torch.testing.assert_close(out.float(), plain.float(), atol=1e-4, rtol=2**-7)


@needs_amx
@pytest.mark.parametrize("rows", [3, 35])  # one group of tokens; three (the NaN's is the first)
def test_a_nan_or_an_infinity_reaches_its_tokens_outputs_only(kernels, rows):
    (weight, laid_out), x = tiles(kernels, 64, 64), bf16(rows, 64)
    x[0, 5], x[rows - 1, 9] = float("nan"), float("inf")
    out = kernels.amx_bf16_gemv(x, laid_out).float()
    assert out[0].isnan().all() and out[1 : rows - 1].isfinite().all()
    expected = x.float() @ weight.float().T  # +-inf, or NaN where a weight is 0
    assert torch.equal(out[rows - 1].isinf(), expected[rows - 1].isinf())


@needs_amx
@pytest.mark.parametrize("rows", [4, 37])  # one group of tokens; three
def test_strided_tokens_and_any_thread_count_give_the_same_outputs(kernels, rows):
    _, laid_out = tiles(kernels, 16 * 5, 256)  # five blocks: two threads take two and three
    wide = bf16(rows, 512)
    x = wide[:, ::2]  # not contiguous
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.amx_bf16_gemv(x.contiguous(), laid_out)
        torch.set_num_threads(2)
        two = kernels.amx_bf16_gemv(x, laid_out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one thread's sum, in the same order


@needs_amx
def test_it_refuses_what_it_does_not_multiply(kernels):
    _, laid_out = tiles(kernels, 32, 64)
    refused = [
        (bf16(2, 64), bf16(32, 64)),  # the plain weight
        (bf16(2, 96), laid_out),  # k differs
        (bf16(81, 64), laid_out),  # more tokens than five tiles' rows
        (torch.randn(2, 64), laid_out),  # float32 tokens
        (bf16(2, 64), laid_out.float()),  # a float32 weight
    ]
    for x, weight in refused:
        assert not kernels.amx_gemv_applies(x, weight)
        with pytest.raises(RuntimeError, match="unsupported shapes"):
            kernels.amx_bf16_gemv(x, weight)
    for weight in (bf16(37, 64), bf16(32, 96)[:, :64], bf16(32, 40)):  # rows, strided, k
        with pytest.raises(RuntimeError, match="not whole tiles"):
            kernels.amx_gemv_layout(weight)
