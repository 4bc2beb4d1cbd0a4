"""/v1/chat/completions: vLLM's prompt_logprobs over the templated prompt, continuous usage."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from servers import InProcessServer

TOLERANCE = 2e-5  # fp32 on both sides


def test_chat_prompt_logprobs_cover_the_templated_prompt(server: InProcessServer, hf_model) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)
    prompt = tokenized.json()["tokens"]
    with torch.no_grad():
        rows = hf_model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)  # [N, vocab]
    prompt_logprobs = response["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt) == response["usage"]["prompt_tokens"]
    assert prompt_logprobs[0] is None
    expected = [rows[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    got = [prompt_logprobs[j][str(prompt[j])]["logprob"] for j in range(1, len(prompt))]
    assert got == pytest.approx(expected, abs=TOLERANCE)


def test_chat_continuous_usage_stats(server: InProcessServer) -> None:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, timeout=60
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[len("data: ") :]) for line in lines]
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_tokens[0] == 0 and completion_tokens[-1] == 4
    assert completion_tokens == sorted(completion_tokens)
