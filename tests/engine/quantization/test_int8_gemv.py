"""The compiled int8 GEMV (csrc/gemv.cpp): its products against float32 and PyTorch's."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.cpu_kernels import load_cpu_kernels
from nanoserve.engine.quantization.int8 import MAX_ROWS, quantize_int8


@pytest.fixture(scope="module")
def gemv():
    kernels = load_cpu_kernels()  # compiles on first use (the CI image has g++ and ninja)
    assert kernels is not None, "the CPU kernels did not build; see the warning in the log"
    return kernels.int8_gemv


# in_features: a multiple of the 64-weight step, one with a tail, one shorter than a step.
@pytest.mark.parametrize("in_features", [1024, 1000, 40])
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
def test_gemv_is_the_product_by_the_dequantized_weight(gemv, in_features, rows):
    torch.manual_seed(rows)
    weight = torch.randn(37, in_features)  # an odd number of output rows
    quantized, scales = quantize_int8(weight)
    scales = scales.to(torch.bfloat16)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)  # [rows, in]
    out = gemv(x, quantized, scales)  # [rows, 37]
    assert out.shape == (rows, 37) and out.dtype == torch.bfloat16
    expected = (x.float() @ quantized.float().T) * scales.float()  # float32 sums, then scaled
    # One bf16 rounding of the float32 result (sums differ only in their order).
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=2**-8)
    if in_features % 64 == 0:  # PyTorch's kernel: wrong sums for other widths (torch 2.13)
        aten = torch.ops.aten._weight_int8pack_mm(x, quantized, scales)
        torch.testing.assert_close(out.float(), aten.float(), atol=1e-5, rtol=2**-7)


def test_gemv_refuses_more_rows_than_it_keeps_in_cache(gemv):
    quantized, scales = quantize_int8(torch.randn(8, 64))
    x = torch.randn(MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        gemv(x, quantized, scales.to(torch.bfloat16))


def test_gemv_wants_one_scale_per_output_row(gemv):
    quantized, scales = quantize_int8(torch.randn(8, 64))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one scale per output row"):
        gemv(x, quantized, scales[:-1].to(torch.bfloat16))


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
