"""Prefix caching seen from outside: a repeated long prompt shows up as cache hits in /metrics."""

from __future__ import annotations

import httpx
from servers import InProcessServer, read_metrics

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"


def test_second_request_with_the_same_long_prompt_hits_the_cache(server: InProcessServer) -> None:
    prompt = "".join(chr(ord("a") + i % 26) for i in range(300))  # 300 byte tokens
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert first.status_code == 200
    before = read_metrics(server.url)
    second = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    after = read_metrics(server.url)
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert after[QUERIES] - before[QUERIES] == 300
    # Every token of the prompt but the last: 18 full 16-token blocks, then 11 tokens of the
    # first request's partly filled last block (kept as a tail, taken over by the second).
    assert after[HITS] - before[HITS] == 18 * 16 + 11
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] == 300
