"""CpuMoeMethod: steps of up to 8 pairs per chosen expert through the C++ grouped bf16 GEMV
give the grouped method's products, longer ones take the grouped method; the engine installs it
for bf16 MoE models on CPU."""

from __future__ import annotations

import pytest
import torch
from test_moe_layer import make_block
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.engine_setup import build_engine
from nanoserve.moe.cpu import GEMV_ROWS_PER_PASS, CpuMoeMethod, PairKernels
from nanoserve.moe.layer import GROUPED, ROUTER_GEMV_MAX_TOKENS, MoeMethod, PairOps
from nanoserve.moe.routing import route
from nanoserve.platforms.cpu.kernels import load_cpu_kernels


class Recording(MoeMethod):
    """Records whether each step went to the GEMV (True) or the grouped method."""

    def __init__(self, kernels) -> None:
        self.calls: list[int] = []

        def gemv(*args):
            self.calls.append(args[0].shape[0])
            return kernels.moe_bf16_gemv(*args)

        self.inner = CpuMoeMethod(gemv)

    def apply(self, layer, x, weights, expert_ids):
        return self.inner.apply(layer, x, weights, expert_ids)


@pytest.mark.parametrize("num_tokens", [1, 2, 9, 30])  # 6 experts, top 2: 30 tokens > 8 each
def test_steps_of_few_pairs_an_expert_take_the_gemv_and_equal_the_grouped_method(num_tokens):
    kernels = load_cpu_kernels()
    assert kernels is not None
    block = make_block(seed=5).to(torch.bfloat16)
    x = torch.randn(num_tokens, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = block(x)  # the grouped method
        method = Recording(kernels)
        block.method = method
        got = block(x)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    num_pairs = num_tokens * block.top_k
    num_chosen = len(block.group(*block_routing(block, x)).expert_ids)
    takes_gemv = num_pairs <= GEMV_ROWS_PER_PASS * num_chosen
    assert takes_gemv == (num_tokens < 30)
    assert method.calls == ([num_pairs] * 2 if takes_gemv else [])


def block_routing(block, x):
    """The (weights, expert ids) the block's router gives `x`."""
    with torch.no_grad():
        return route(torch.nn.functional.linear(x, block.gate), block.top_k, block.renormalize)


def test_the_engine_installs_it_for_bf16_models(tmp_path):
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build; see the warning in the log"
    if not kernels.bf16_gemv_is_vectorized():
        pytest.skip("needs a CPU with AVX512-BF16 or AVX2 and FMA (the GEMV's SIMD paths)")
    checkpoint = make_tiny_checkpoint(tmp_path, "mixtral")
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="bfloat16", max_model_len=64)
    blocks = build_engine(config).model.moe_blocks()
    assert blocks and all(isinstance(b.method, CpuMoeMethod) for b in blocks)
    assert all(b.method.router_gemv is kernels.bf16_gemv for b in blocks)
    assert all(isinstance(b.method.pairs, PairKernels) for b in blocks)
    fp32 = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=64)
    assert all(b.method is GROUPED for b in build_engine(fp32).model.moe_blocks())


@pytest.mark.parametrize("num_tokens", [1, 8, 9])
def test_the_router_product_of_a_decode_step_goes_through_the_gemv(num_tokens):
    kernels = load_cpu_kernels()
    assert kernels is not None
    block = make_block(seed=6).to(torch.bfloat16)
    x = torch.randn(num_tokens, 32, dtype=torch.bfloat16)
    calls = []

    def router_gemv(tokens, gate):
        calls.append(tokens.shape[0])
        return kernels.bf16_gemv(tokens, gate)

    method = CpuMoeMethod(kernels.moe_bf16_gemv)
    method.router_gemv = router_gemv
    with torch.no_grad():
        logits = method.router_logits(block, x)
        expected = torch.nn.functional.linear(x, block.gate)
        torch.testing.assert_close(logits.float(), expected.float(), atol=2e-2, rtol=2e-2)
        reference = block(x)  # the grouped method, PyTorch's router product
        block.method = method
        torch.testing.assert_close(block(x).float(), reference.float(), atol=2e-2, rtol=2e-2)
    assert calls == ([num_tokens] * 2 if num_tokens <= ROUTER_GEMV_MAX_TOKENS else [])


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "first", "count"),
    [
        (1, 128, 8, 0, 128),  # a decode step of the Qwen3-30B-A3B shape
        (8, 16, 4, 0, 16),  # a batch: most experts chosen, some by several tokens
        (300, 8, 2, 0, 8),  # a prefill
        (6, 8, 3, 2, 4),  # expert parallelism: this rank's 4 experts of 8
        (3, 8, 2, 6, 2),  # few local experts: tokens none of them serve, experts none picked
    ],
)
def test_the_pair_kernels_group_and_sum_as_pytorch_does_bit_for_bit(
    num_tokens, num_experts, top_k, first, count
):
    kernels = load_cpu_kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=generator).to(torch.bfloat16)
    logits[:, 1] = logits[:, 0]  # ties between router scores
    weights, expert_ids = route(logits, top_k, renormalize=True)
    ours, reference = PairKernels(kernels), PairOps()
    groups = ours.group(expert_ids, weights, first, count)
    expected = reference.group(expert_ids, weights, first, count)
    for name in ("token_index", "weights", "expert_of", "expert_ids", "offsets"):
        got, want = getattr(groups, name), getattr(expected, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    x = torch.randn(num_tokens, 48, generator=generator).to(torch.bfloat16)
    expert_out = torch.randn(len(groups.token_index), 48, generator=generator).to(torch.bfloat16)
    summed = ours.combine(x, groups, expert_out)
    assert summed.dtype == torch.bfloat16
    assert torch.equal(summed, reference.combine(x, expected, expert_out))
