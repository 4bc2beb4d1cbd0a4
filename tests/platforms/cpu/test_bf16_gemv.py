"""The compiled bf16 GEMV (csrc/gemv.cpp): float32 sums of exact products, rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.common.cpu_features import cpu_flags


def test_it_is_vectorized_where_the_cpu_has_bf16_dot_or_avx2_fma_instructions(kernels):
    flags = cpu_flags() or []
    has_simd = "avx512_bf16" in flags or ("avx2" in flags and "fma" in flags)
    assert kernels.bf16_gemv_is_vectorized() == has_simd


# in_features: a multiple of every step (AVX-512: 32 weights per dot, AVX2: 16), one with a
# tail past both (1000 = 62 * 16 + 8), one shorter than an unrolled step (40), one shorter
# than any vector (7: all tail).
# rows: 1-8 in one vector pass, 9-16 in two, 17-80 in up to ten (37 weight rows: a shape AMX's
# tiles do not take).
@pytest.mark.parametrize("in_features", [1024, 1000, 40, 7])
@pytest.mark.parametrize("rows", [*range(1, 10), 12, 16, 17, 80])
def test_gemv_is_the_float32_product_rounded_once(kernels, in_features, rows):
    torch.manual_seed(rows)
    weight = torch.randn(37, in_features, dtype=torch.bfloat16)  # an odd number of rows
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)  # [rows, in]
    out = kernels.bf16_gemv(x, weight)  # [rows, 37]
    assert out.shape == (rows, 37) and out.dtype == torch.bfloat16
    expected = x.float() @ weight.float().T  # bf16 products are exact in float32
    # One bf16 rounding of the float32 sums (which differ only in their order).
    torch.testing.assert_close(out.float(), expected, atol=1e-4, rtol=2**-8)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=2**-7)


def test_gemv_reads_strided_activations_and_refuses_eighty_one_rows(kernels):
    weight = torch.randn(16, 64, dtype=torch.bfloat16)
    wide = torch.randn(2, 128, dtype=torch.bfloat16)
    x = wide[:, ::2]  # not contiguous
    assert torch.equal(kernels.bf16_gemv(x, weight), kernels.bf16_gemv(x.contiguous(), weight))
    with pytest.raises(RuntimeError, match="1 to 80 rows"):
        kernels.bf16_gemv(torch.randn(81, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(RuntimeError):
        kernels.bf16_gemv(torch.randn(1, 64), weight)  # float32 activations


def test_gemv_splits_rows_across_threads_without_changing_them(kernels):
    weight = torch.randn(4099, 256, dtype=torch.bfloat16)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.bf16_gemv(x, weight)
        torch.set_num_threads(2)
        two = kernels.bf16_gemv(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one thread's sum, in the same order
