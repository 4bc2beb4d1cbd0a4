"""The grouped MoE GEMVs (csrc/gemv.cpp): each group of rows times its own expert, only the
named experts read; the same sums as the single-weight GEMVs."""

from __future__ import annotations

import pytest
import torch

from nanoserve.quantization.int8 import pair_rows, quantize_int8


def groups(counts: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """expert -> rows: (expert_ids [U], offsets [U + 1])."""
    ids = torch.tensor(list(counts), dtype=torch.int64)
    offsets = torch.tensor([0, *torch.tensor(list(counts.values())).cumsum(0).tolist()])
    return ids, offsets


# Experts 0 and 5 take no rows; expert 3 has 10 rows (more than one 8-row pass).
COUNTS = [{2: 1}, {1: 1, 4: 2, 6: 1}, {3: 10, 1: 3}]


@pytest.mark.parametrize("counts", COUNTS)
def test_bf16_groups_each_times_their_expert(kernels, counts):
    torch.manual_seed(0)
    # 7 experts, odd N, K with a tail past the 32- (AVX-512) and 16-weight (AVX2) steps.
    weight = torch.randn(7, 37, 100, dtype=torch.bfloat16)
    ids, offsets = groups(counts)
    x = torch.randn(int(offsets[-1]), 100, dtype=torch.bfloat16)
    out = kernels.moe_bf16_gemv(x, weight, ids, offsets)
    for u, expert in enumerate(ids.tolist()):
        rows = slice(int(offsets[u]), int(offsets[u + 1]))
        expected = x[rows].float() @ weight[expert].float().T
        torch.testing.assert_close(out[rows].float(), expected, atol=1e-4, rtol=2**-8)
        # The same sums as the one-weight GEMV (rows up to 8 at a time).
        for start in range(rows.start, rows.stop, 8):
            chunk = slice(start, min(rows.stop, start + 8))
            assert torch.equal(out[chunk], kernels.bf16_gemv(x[chunk], weight[expert]))


@pytest.mark.parametrize("counts", COUNTS)
def test_int8_groups_equal_the_one_weight_int8_gemv(kernels, counts):
    torch.manual_seed(1)
    weight = torch.randn(7, 37, 64)
    quantized = [quantize_int8(expert) for expert in weight]
    pairs = torch.stack([pair_rows(q) for q, _ in quantized])  # [7, 19, 128]
    scales = torch.stack([s for _, s in quantized])  # [7, 37] float32
    ids, offsets = groups(counts)
    x = torch.randn(int(offsets[-1]), 64, dtype=torch.bfloat16)
    out = kernels.moe_int8_gemv(x, pairs, scales, ids, offsets)
    for u, expert in enumerate(ids.tolist()):
        for start in range(int(offsets[u]), int(offsets[u + 1]), 8):
            chunk = slice(start, min(int(offsets[u + 1]), start + 8))
            one = kernels.int8_gemv(x[chunk], pairs[expert], scales[expert])
            assert torch.equal(out[chunk], one)


def test_bad_groups_are_refused(kernels):
    weight = torch.randn(4, 8, 32, dtype=torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        kernels.moe_bf16_gemv(x, weight, torch.tensor([4]), torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="offsets span"):
        kernels.moe_bf16_gemv(x, weight, torch.tensor([1]), torch.tensor([0, 2]))
    empty = kernels.moe_bf16_gemv(
        x[:0], weight, torch.tensor([], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    )
    assert empty.shape == (0, 8)
