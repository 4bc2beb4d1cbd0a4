"""CpuMoeMethod: decode steps through the C++ grouped bf16 GEMV give the grouped method's
products; the engine installs it for bf16 MoE models on CPU."""

from __future__ import annotations

import pytest
import torch
from test_moe_layer import make_block
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.engine_setup import build_engine
from nanoserve.moe.cpu import GEMV_MAX_TOKENS, CpuMoeMethod
from nanoserve.moe.layer import GROUPED, MoeMethod
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


@pytest.mark.parametrize("num_tokens", [1, 2, 4, 9])
def test_decode_steps_take_the_gemv_and_equal_the_grouped_method(num_tokens):
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
    is_decode = num_tokens <= GEMV_MAX_TOKENS
    assert method.calls == ([num_tokens * block.top_k] * 2 if is_decode else [])


def test_the_engine_installs_it_for_bf16_models(tmp_path):
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build; see the warning in the log"
    if not kernels.bf16_gemv_is_vectorized():
        pytest.skip("needs a CPU with AVX512-BF16 or AVX2 and FMA (the GEMV's SIMD paths)")
    checkpoint = make_tiny_checkpoint(tmp_path, "mixtral")
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="bfloat16", max_model_len=64)
    blocks = build_engine(config).model.moe_blocks()
    assert blocks and all(isinstance(b.method, CpuMoeMethod) for b in blocks)
    fp32 = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=64)
    assert all(b.method is GROUPED for b in build_engine(fp32).model.moe_blocks())
