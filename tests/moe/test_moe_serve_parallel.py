"""MoE models served by two ranks on CPU (gloo), `nanoserve serve -tp 2` with and without
`--enable-expert-parallel`: the same greedy tokens as transformers, also when prompts are
chunked, requests preempted and prefixes served from the cache."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import transformers
from servers import ServerProcess, read_metrics
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 3], [250, 42, 7, 8, 9, 11, 13, 200, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_TOKENS = 10
# Six prompts of 20-40 tokens at once into 6 blocks of 16 slots, 16 tokens a step: chunked
# prompts, preempted requests, and (sent twice) prefixes found in the cache.
_rng = random.Random(0)
BUSY_PROMPTS = [[_rng.randrange(1, 256) for _ in range(n)] for n in (20, 24, 28, 32, 36, 40)]
BUSY_FLAGS = ("--num-kv-blocks", "6", "--max-num-batched-tokens", "16", "--max-num-seqs", "6")


def one_rank_outputs(checkpoint, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    return [o.outputs[0] for o in LLM(str(checkpoint), dtype="float32").generate(prompts, params)]


def complete(url: str, prompt: list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


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
    outputs = one_rank_outputs(checkpoint, PROMPTS)
    assert [o.token_ids for o in outputs] == expected
    with ServerProcess(checkpoint, tmp_path / "server.log", "-tp", "2", *flags) as server:
        assert len(server.worker_pids()) == 2
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            assert complete(server.url, prompt) == output.text


@pytest.mark.parametrize("flags", [(), ("--enable-expert-parallel",)], ids=["tp2", "ep2"])
def test_two_ranks_chunk_preempt_and_cache_as_one_rank_decodes(tmp_path, flags):
    checkpoint = make_tiny_checkpoint(tmp_path / "model", "mixtral")
    expected = [o.text for o in one_rank_outputs(checkpoint, BUSY_PROMPTS)]
    args = ("-tp", "2", *flags, *BUSY_FLAGS)
    with ServerProcess(checkpoint, tmp_path / "server.log", *args) as server:
        with ThreadPoolExecutor(len(BUSY_PROMPTS)) as pool:
            for _ in range(2):  # the second round finds the first one's blocks
                got = list(pool.map(lambda p: complete(server.url, p), BUSY_PROMPTS))
                assert got == expected
        metrics = read_metrics(server.url)
    assert metrics["vllm:num_preemptions_total"] > 0
    assert metrics["vllm:prefix_cache_hits_total"] > 0
