"""The compiled int8 GEMV (csrc/gemv.cpp, csrc/block_gemv.cpp): its products against float32
and PyTorch's, with the weight in each layout it streams: row pairs (`pair_rows`) and blocks of
64 rows (`int8_gemv_blocks`, on CPUs with AVX512-BW)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.common.cpu_features import cpu_flags
from nanoserve.platforms.cpu.kernels import load_cpu_kernels
from nanoserve.quantization.int8 import (
    MAX_ROWS,
    pair_rows,
    quantize_int8,
    unpair_rows,
    widen_gemv_layout,
)

HAS_AVX512BW = "avx512bw" in (cpu_flags() or [])


@pytest.fixture(scope="module", params=["pairs", "blocks"])
def gemv(request):
    """int8_gemv(x, weight [N, K], scales [N]) through one layout. For blocks, the weight and
    scales are padded to whole blocks of 64 rows and the padding's outputs dropped."""
    kernels = load_cpu_kernels()  # compiles on first use (the CI image has g++ and ninja)
    assert kernels is not None, "the CPU kernels did not build; see the warning in the log"
    if request.param == "pairs":
        return lambda x, weight, scales: kernels.int8_gemv(x, pair_rows(weight), scales)
    if not HAS_AVX512BW:
        pytest.skip("the int8 GEMV's blocks need AVX512-BW, which this CPU lacks")

    def in_blocks(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        rows, padding = weight.shape[0], -weight.shape[0] % 64
        blocks = kernels.int8_gemv_blocks(F.pad(weight, (0, 0, 0, padding)))
        scales = torch.cat([scales, torch.ones(padding, dtype=scales.dtype)])
        return kernels.int8_gemv(x, blocks, scales)[:, :rows]

    return in_blocks


@pytest.mark.parametrize(("rows", "width"), [(37, 1024), (38, 96), (1, 32)])
def test_row_pairs_interleave_32_weights_and_come_back(rows, width):
    weight = torch.randint(-127, 128, (rows, width), dtype=torch.int8)
    pairs = pair_rows(weight)  # [P, 2K]: 32 of row 2p, then the same 32 of row 2p + 1, ...
    assert pairs.shape == ((rows + 1) // 2, 2 * width)
    padded = torch.cat([weight, torch.zeros(rows % 2, width, dtype=torch.int8)])
    assert torch.equal(pairs[0, :32], padded[0, :32])
    assert torch.equal(pairs[0, 32:64], padded[1, :32])
    assert torch.equal(unpair_rows(pairs, rows, torch.float32), weight.float())


def test_blocks_hold_each_k_pair_of_64_rows_side_by_side_and_come_back():
    kernels = load_cpu_kernels()
    weight = torch.randint(-127, 128, (128, 96), dtype=torch.int8)
    blocks = kernels.int8_gemv_blocks(weight)
    if not HAS_AVX512BW:  # the GEMV reads row pairs there
        assert blocks is None
        return
    assert blocks.shape == (2, 48, 64, 2)  # [N/64, K/2, 64, 2]
    assert blocks[1, 5, 7, 0] == weight[64 + 7, 10] and blocks[1, 5, 7, 1] == weight[64 + 7, 11]
    assert torch.equal(widen_gemv_layout(blocks, 128, torch.float32), weight.float())
    assert torch.equal(widen_gemv_layout(pair_rows(weight), 128, torch.float32), weight.float())
    assert kernels.int8_gemv_blocks(weight[:100]) is None  # not whole blocks of 64 rows
    assert kernels.int8_gemv_blocks(weight[:, :95].contiguous()) is None  # K odd
    assert kernels.int8_gemv_blocks(weight.float()) is None  # not int8


def int16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV's activations, written out: [M, K] -> ([M, K] int16 values, [M] powers of two)
    with x ≈ values * scale, the smallest power of two that fits each row's largest in int16."""
    largest = x.float().abs().amax(dim=1)  # [M]
    exponents = torch.frexp(largest).exponent  # largest < 2^exponent
    scales = torch.where(largest > 0, torch.ldexp(torch.ones_like(largest), exponents - 15), 1.0)
    values = torch.round(x.float() / scales[:, None]).clamp(-32768, 32767)
    return values.to(torch.int16), scales


# in_features: a multiple of the 64-weight step, one 32-weight chunk past it, one chunk alone.
@pytest.mark.parametrize("in_features", [1024, 1056, 32])
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
def test_gemv_is_the_product_by_the_dequantized_weight(gemv, in_features, rows):
    torch.manual_seed(rows)
    weight = torch.randn(37, in_features)  # an odd number of output rows
    quantized, scales = quantize_int8(weight)
    scales = scales.to(torch.bfloat16)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)  # [rows, in]
    out = gemv(x, quantized, scales)  # [rows, 37]
    assert out.shape == (rows, 37) and out.dtype == torch.bfloat16
    values, x_scales = int16_rows(x)
    exact = (values.double() @ quantized.double().T) * x_scales.double()[:, None]
    expected = (exact * scales.double()).float()  # exact integer sums, then scaled
    # One bf16 rounding of the float32 result (whose lanes add up in float32).
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)
    # The int16 rounding of activations is far below bf16's own: against bf16 x itself too.
    unrounded = (x.float() @ quantized.float().T) * scales.float()
    torch.testing.assert_close(out.float(), unrounded, atol=1e-3, rtol=2**-7)
    if in_features % 64 == 0:  # PyTorch's kernel: wrong sums for other widths (torch 2.13)
        aten = torch.ops.aten._weight_int8pack_mm(x, quantized, scales)
        torch.testing.assert_close(out.float(), aten.float(), atol=1e-3, rtol=2**-7)


def test_activations_within_2_to_the_7_of_the_largest_are_exact():
    x = torch.tensor([[1000.0, -3.5, 7.8125, 0.01]], dtype=torch.bfloat16)
    values, scales = int16_rows(x)
    assert scales.item() == 2.0**-5  # 1000 < 2^10
    restored = values.float() * scales[:, None]
    assert torch.equal(restored[0, :3], x[0, :3].float())  # 1000/2^7 < |v|: exact
    assert abs(restored[0, 3] - 0.01) <= 2.0**-6  # smaller ones: within half a step


def test_a_row_longer_than_int32_holds_sums_in_chunks(gemv):
    # All weights 127 and activations at the top of int16: 20,000 products overflow an int32
    # lane unless the kernel folds its integer sums into float32 every 8,192 weights.
    in_features = 20_000
    quantized = torch.full((3, in_features), 127, dtype=torch.int8)
    scales = torch.tensor([1.0, 0.5, 2.0])
    x = torch.full((2, in_features), 0.99, dtype=torch.bfloat16)
    x[1] = -x[1]
    out = gemv(x, quantized, scales).float()
    values, x_scales = int16_rows(x)
    sums = values.double().sum(dim=1) * 127 * x_scales.double()  # [2]
    expected = (sums[:, None] * scales.double()).float()
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-8)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_row_with_a_non_finite_activation_gives_no_finite_product(gemv, bad):
    quantized, scales = quantize_int8(torch.randn(20, 128))
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    x[1, 37] = bad
    x3 = torch.cat([x, torch.randn(1, 128, dtype=torch.bfloat16)])
    x3[2, 127] = bad
    out = gemv(x3, quantized, scales)
    assert torch.isfinite(out[0]).all()  # the other row is untouched
    assert out[1:].isnan().all()
    aten = x3.float() @ (quantized.float() * scales[:, None]).T  # PyTorch: inf or NaN too
    assert (~torch.isfinite(aten[1:])).all()


def test_float32_activations_that_round_to_2_to_the_15_saturate_to_32767(gemv):
    """A float32 activation a hair under the row's power of two rounds to 32768, one past
    int16: it becomes 32767 (-32768 is in range), in every vector lane and position."""
    quantized = torch.randint(-127, 128, (5, 64), dtype=torch.int8)
    scales = torch.tensor([1.0, 0.5, 2.0, 0.25, 1.0])
    x = torch.randn(2, 64) / 4
    x[0, ::3] = 0.99999  # 0.99999 * 2^15 = 32767.67
    x[1, 1::5] = -0.99999
    values, x_scales = int16_rows(x)
    assert values[0, 0] == 32767 and values[1, 1] == -32768
    out = gemv(x, quantized, scales)
    exact = (values.double() @ quantized.double().T) * x_scales.double()[:, None]
    torch.testing.assert_close(out, (exact * scales.double()).float(), atol=1e-5, rtol=1e-6)


def test_float32_scales_are_read_as_bf16_ones_converted(gemv):
    torch.manual_seed(1)
    quantized, scales = quantize_int8(torch.randn(300, 256))
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    bf16_scales = scales.to(torch.bfloat16)
    assert torch.equal(gemv(x, quantized, bf16_scales), gemv(x, quantized, bf16_scales.float()))


def test_every_prefetch_distance_gives_the_same_products(gemv):
    kernels = load_cpu_kernels()
    torch.manual_seed(2)
    quantized, scales = quantize_int8(torch.randn(500, 1024))
    bf16_weight = torch.randn(500, 1024, dtype=torch.bfloat16)
    x = torch.randn(2, 1024, dtype=torch.bfloat16)
    chosen = kernels.gemv_prefetch()
    try:
        results = []
        for bytes_ahead in (0, 64, 4096):
            kernels.set_gemv_prefetch(bytes_ahead)
            assert kernels.gemv_prefetch() == bytes_ahead
            results.append((gemv(x, quantized, scales), kernels.bf16_gemv(x, bf16_weight)))
        for int8_out, bf16_out in results[1:]:
            assert torch.equal(int8_out, results[0][0]) and torch.equal(bf16_out, results[0][1])
        with pytest.raises(RuntimeError, match="bytes ahead"):
            kernels.set_gemv_prefetch(-1)
    finally:
        kernels.set_gemv_prefetch(chosen)


def test_gemv_refuses_more_rows_than_it_keeps_in_cache(gemv):
    quantized, scales = quantize_int8(torch.randn(8, 64))
    x = torch.randn(MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        gemv(x, quantized, scales.to(torch.bfloat16))


def test_gemv_wants_one_scale_per_output_row_and_whole_chunks():
    quantized, scales = quantize_int8(torch.randn(8, 64))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    kernels = load_cpu_kernels()
    with pytest.raises(RuntimeError, match="one scale per output row"):  # 4 pairs: 7 or 8 rows
        kernels.int8_gemv(x, pair_rows(quantized), scales[:-2].to(torch.bfloat16))
    blocks = torch.zeros(1, 32, 64, 2, dtype=torch.int8)  # one block: 64 rows, K = 64
    with pytest.raises(RuntimeError, match="blocks are"):
        kernels.int8_gemv(x, blocks, torch.ones(63))
    with pytest.raises(RuntimeError, match="a multiple of 32"):
        kernels.int8_gemv(
            torch.randn(1, 40, dtype=torch.bfloat16), torch.zeros(4, 80, dtype=torch.int8), scales
        )


def test_gemv_splits_rows_across_threads_without_changing_them(gemv):
    quantized, scales = quantize_int8(torch.randn(4099, 256))
    scales = scales.to(torch.bfloat16)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv(x, quantized, scales)
        torch.set_num_threads(2)
        two = gemv(x, quantized, scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one thread's sum, in the same order
