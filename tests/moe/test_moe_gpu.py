"""MoE models on CUDA (the Triton fused-MoE kernels, CUDA graphs over decode steps): the same
greedy tokens as transformers on the GPU in fp32, and the kernels at full size in bf16."""

import pytest
import torch
import transformers
from tiny_checkpoints import MOE_ARCHITECTURES, make_tiny_checkpoint

from nanoserve.common.config import EngineConfig, ModelConfig, MoeConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.parallel import TensorParallel
from nanoserve.engine_setup import build_engine
from nanoserve.moe.layer import GROUPED, QWEN3_MOE_NAMES, SparseMoeBlock
from nanoserve.moe.routing import route
from nanoserve.moe.triton_moe import TritonMoeMethod

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_cuda_moe_greedy_equals_transformers_with_cuda_graphs(tmp_path, architecture):
    checkpoint = make_tiny_checkpoint(tmp_path, architecture)
    prompts = [[1 + i] * (3 + 7 * i) for i in range(6)]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = model.cuda()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10)
        expected.append(out[0, len(prompt) :].tolist())
    config = EngineConfig(
        model=str(checkpoint),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
    )
    engine = build_engine(config)
    assert [r.name for r in engine.runner.step_runners] == ["cuda-graphs", "eager"]
    assert all(isinstance(b.method, TritonMoeMethod) for b in engine.model.moe_blocks())
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    tokens = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    assert [tokens[str(i)] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_triton_moe_at_qwen3_30b_a3b_size_equals_the_grouped_method(num_tokens):
    config = ModelConfig(
        "Qwen3MoeForCausalLM",
        1000,
        2048,
        6144,
        1,
        32,
        4,
        128,
        4096,
        1e-6,
        1e6,
        moe=MoeConfig(128, 8, 768, norm_topk_prob=True),
    )  # one layer of Qwen3-30B-A3B
    with torch.device("cuda"):
        block = SparseMoeBlock(config, TensorParallel(), False, QWEN3_MOE_NAMES)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.02)
    block = block.to(torch.bfloat16)
    x = torch.randn(num_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    weights, expert_ids = route(x @ block.gate.T, 8, True)
    with torch.no_grad():
        ours = TritonMoeMethod().apply(block, x, weights, expert_ids)
        reference = GROUPED.apply(block, x, weights, expert_ids)
    torch.testing.assert_close(ours.float(), reference.float(), atol=2e-2, rtol=2e-2)
