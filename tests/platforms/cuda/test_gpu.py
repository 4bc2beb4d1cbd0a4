"""The engine on CUDA (Triton attention, CUDA graphs): the same greedy tokens as transformers
on the GPU for every architecture in fp32; bf16 and fp16 run end to end."""

import pytest
import torch
import transformers
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.engine_setup import build_engine

pytestmark = pytest.mark.gpu


def generate(engine, prompts, params):
    tokens = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama", "mistral"])
def test_cuda_fp32_greedy_equals_transformers(tmp_path, architecture):
    checkpoint = make_tiny_checkpoint(tmp_path, architecture)
    prompts = [[1 + i] * (3 + 7 * i) for i in range(6)]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = model.cuda()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=10,
            min_new_tokens=10,
        )
        expected.append(out[0, len(prompt) :].tolist())
    engine = build_engine(
        EngineConfig(
            model=str(checkpoint),
            device="cuda",
            dtype="float32",
            max_model_len=256,
            gpu_memory_utilization=0.3,
        )
    )
    assert engine.kv_cache.num_blocks > 0 and engine.kv_cache.backend.name == "triton"
    assert [r.name for r in engine.runner.step_runners] == ["cuda-graphs", "eager"]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    assert generate(engine, prompts, params) == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_dummy_preset_runs_end_to_end(tmp_path, dtype):
    engine = build_engine(
        EngineConfig(
            model="Qwen/Qwen3-0.6B",
            load_format="dummy",
            device="cuda",
            dtype=dtype,
            max_model_len=1024,
            gpu_memory_utilization=0.5,
        )
    )
    out = generate(
        engine,
        [[1, 2, 3]] * 4,
        SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=1),
    )
    assert all(len(tokens) == 16 for tokens in out)
    assert engine.stats().kv_cache_usage == 0.0
