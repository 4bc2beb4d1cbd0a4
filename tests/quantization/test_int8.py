"""int8 weight-only linears: per-channel quantization, the CPU kernel's products, the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.common.cpu_features import cpu_flags
from nanoserve.core.layers.linear import Linear
from nanoserve.platforms.cpu.kernels import load_cpu_kernels
from nanoserve.platforms.cpu.linear import (
    PackedLinearMethod,
    WideningLinearMethod,
    packing_works,
)
from nanoserve.quantization.int8 import (
    Int8LinearMethod,
    install_int8_linears,
    quantize_int8,
)


def test_per_channel_quantization_keeps_each_row_within_half_a_step():
    torch.manual_seed(0)
    # rows of every scale, in two whole chunks of QUANTIZE_CHUNK_ROWS and a part of one
    weight = torch.randn(150, 64) * torch.linspace(0.01, 2.0, 150)[:, None]
    weight[3] = weight[140] = 0.0  # an all-zero row must not divide by zero
    quantized, scales = quantize_int8(weight)
    absmax = weight.abs().amax(1)
    assert torch.equal(scales, torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax)))
    assert torch.equal(quantized.float(), (weight / scales[:, None]).round())
    assert quantized.dtype == torch.int8 and quantized.abs().max() <= 127
    restored = quantized.float() * scales[:, None]
    assert ((restored - weight).abs() <= scales[:, None] / 2 + 1e-7).all()
    assert torch.equal(restored[3], torch.zeros(64)) and torch.equal(restored[140], torch.zeros(64))


def avx512bw() -> bool:
    return "avx512bw" in (cpu_flags() or [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
# (out, in): row pairs; neither pairs (40 is not whole 32-weight chunks) nor blocks; whole
# blocks of 64 rows (where the CPU has AVX512-BW) twice, the second one only in blocks
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(48, 64), (48, 40), (128, 64), (128, 40)]
)
def test_int8_linear_multiplies_by_the_dequantized_weight(dtype, bias, out_features, in_features):
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    quantized, scales = quantize_int8(layer.weight.detach())
    dequantized = (quantized.float() * scales[:, None]).to(dtype)
    bias_values = None if layer.bias is None else layer.bias.detach().clone()
    kernels = load_cpu_kernels()  # the CPU kernels build here
    installed = install_int8_linears(layer, gemv=kernels.int8_gemv, blocks=kernels.int8_gemv_blocks)
    assert installed == 1 and isinstance(layer.method, Int8LinearMethod)
    assert layer.weight is None
    in_blocks = avx512bw() and out_features % 64 == 0
    assert layer.int8_in_gemv_layout == (in_blocks or in_features % 32 == 0)
    if layer.int8_in_gemv_layout:  # blocks [N/64, K/2, 64, 2], or row pairs [N/2, 2K]
        assert layer.int8_weight.dim() == (4 if in_blocks else 2)
        assert layer.int8_weight.numel() == out_features * in_features
    for num_tokens in (1, 5, 9, 40):  # the GEMV, and the widened product beyond 8 rows
        x = torch.randn(num_tokens, in_features, dtype=dtype)
        expected = F.linear(x.float(), dequantized.float(), None)
        if bias_values is not None:
            expected += bias_values.float()
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(layer(x).float(), expected, atol=tolerance, rtol=tolerance)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int8"), "qwen3", dtype=torch.bfloat16)


def test_engine_quantizes_every_linear_and_keeps_the_lm_head_when_asked(checkpoint):
    llm = LLM(str(checkpoint), dtype="bfloat16", max_model_len=128, quantization="int8")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.method, Int8LinearMethod) for m in linears)
    kept = LLM(
        str(checkpoint),
        dtype="bfloat16",
        max_model_len=128,
        quantization="int8",
        quantize_lm_head=False,
    )
    model = kept.engine.model
    bf16_method = PackedLinearMethod if packing_works() else WideningLinearMethod
    assert isinstance(model.lm_head.method, bf16_method)  # the CPU's bf16 method
    assert isinstance(model.model.layers[0].mlp.down_proj.method, Int8LinearMethod)


def clear_steps(logprobs: list[dict], margin: float) -> int:
    """How many first steps have a top token ahead of the next by more than `margin` nats."""
    for step, candidates in enumerate(logprobs):
        top_two = sorted((lp.logprob for lp in candidates.values()), reverse=True)[:2]
        if top_two[0] - top_two[1] <= margin:
            return step
    return len(logprobs)


def test_int8_greedy_tokens_agree_with_bf16_until_a_near_tie(checkpoint):
    prompts = [[5, 17, 99, 3], [250, 42, 7, 8, 9, 11], [100] * 12]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=2)
    bf16 = LLM(str(checkpoint), dtype="bfloat16", max_model_len=128)
    int8 = LLM(str(checkpoint), dtype="bfloat16", max_model_len=128, quantization="int8")
    reference = [o.outputs[0] for o in bf16.generate(prompts, params)]
    ours = [o.outputs[0].token_ids for o in int8.generate(prompts, params)]
    # int8 rounding moves logits by a few hundredths of a nat in this random model: the tokens
    # are the same up to the first step whose top two are closer than that (a near-tie).
    clear = [clear_steps(out.logprobs, margin=0.05) for out in reference]
    assert sum(clear) >= 24  # the comparison covers at least a third of the 72 steps
    for tokens, out, steps in zip(ours, reference, clear, strict=True):
        assert tokens[:steps] == out.token_ids[:steps]
