"""int8 experts: the product by the dequantized weights (the C++ grouped GEMV for decode
steps, widened weights otherwise), and logits within a stated tolerance of transformers'."""

from __future__ import annotations

import pytest
import torch
from test_moe_layer import make_block
from test_moe_models import random_prompt, run_batch
from tiny_checkpoints import MOE_ARCHITECTURES, make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve.common.config import EngineConfig
from nanoserve.core.loader import load_model
from nanoserve.engine_setup import build_engine
from nanoserve.moe.int8 import Int8MoeMethod
from nanoserve.moe.layer import GROUPED, install_moe_method
from nanoserve.moe.models import moe_model_classes
from nanoserve.platforms.cpu.kernels import load_cpu_kernels
from nanoserve.quantization.int8 import quantize_int8

# Max |logit difference| from transformers' float32 logits with int8 experts (the rest in
# float32) on the tiny models, whose logits spread with a standard deviation of ~1.7.
INT8_EXPERTS_TOLERANCE = 0.2


def dequantized(weight: torch.Tensor) -> torch.Tensor:  # [E, N, K] -> the int8 values scaled
    return torch.stack([q.float() * s[:, None] for q, s in map(quantize_int8, weight)])


@pytest.mark.parametrize("gemv", [False, True], ids=["widened", "cpu-gemv"])
@pytest.mark.parametrize("num_tokens", [1, 3, 11])
def test_int8_experts_multiply_by_their_dequantized_weights(gemv, num_tokens):
    kernels = load_cpu_kernels() if gemv else None
    block = make_block(seed=3)
    dtype = torch.bfloat16 if gemv else torch.float32
    plain = make_block(seed=3)
    with torch.no_grad():
        plain.w13.copy_(dequantized(block.w13))
        plain.w2.copy_(dequantized(block.w2))
    block = block.to(dtype)  # the reference stays float32
    install_moe_method(block, Int8MoeMethod(kernels.moe_int8_gemv if kernels else None))
    assert block.w13 is None and block.int8_w13.paired == gemv
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        got, expected = block(x), plain(x.float())
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # bf16 activations, router and sums: within a percent or two overall
        assert ((got.float() - expected).norm() / expected.norm()).item() < 0.02
    assert plain.method is GROUPED


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_int8_expert_logits_are_within_the_stated_tolerance(tmp_path, architecture):
    checkpoint = make_tiny_checkpoint(tmp_path, architecture)
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32")
    loaded = load_model(config, model_classes=moe_model_classes())
    assert install_moe_method(loaded.model, Int8MoeMethod()) == len(loaded.model.moe_blocks())
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = [random_prompt(n, seed=n) for n in (4, 9, 33)]
    steps = run_batch(loaded, prompts, num_decodes=3)
    for seq, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        got = torch.cat([step[seq] for step in steps])
        difference = (got - expected).abs().max().item()
        assert 0 < difference <= INT8_EXPERTS_TOLERANCE


def test_the_engine_runs_int8_experts_and_int8_linears(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3_moe")
    config = EngineConfig(
        model=str(checkpoint), device="cpu", dtype="bfloat16", quantization="int8", max_model_len=64
    )
    engine = build_engine(config)
    blocks = engine.model.moe_blocks()
    assert blocks and all(isinstance(b.method, Int8MoeMethod) for b in blocks)
    assert all(b.method.gemv is not None for b in blocks)  # decode steps by the C++ GEMV
