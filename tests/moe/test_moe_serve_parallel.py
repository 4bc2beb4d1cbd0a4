"""MoE models served by two ranks on CPU (gloo), `nanoserve serve -tp 2` with and without
`--enable-expert-parallel`: the same greedy tokens as transformers."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers
from servers import ServerProcess
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 3], [250, 42, 7, 8, 9, 11, 13, 200, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_TOKENS = 10


@pytest.mark.parametrize("flags", [(), ("--enable-expert-parallel",)], ids=["tp2", "ep2"])
def test_two_ranks_serve_transformers_greedy_tokens(tmp_path, flags):
    checkpoint = make_tiny_checkpoint(tmp_path / "model", "qwen3_moe")
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = reference.generate(
            ids, do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS
        )
        expected.append(out[0, len(prompt) :].tolist())
    # One rank in-process gives transformers' tokens; its text is what the server must answer.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outputs = [
        o.outputs[0] for o in LLM(str(checkpoint), dtype="float32").generate(PROMPTS, params)
    ]
    assert [o.token_ids for o in outputs] == expected
    with ServerProcess(checkpoint, tmp_path / "server.log", "-tp", "2", *flags) as server:
        assert len(server.worker_pids()) == 2
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            body = {
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "min_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == output.text
