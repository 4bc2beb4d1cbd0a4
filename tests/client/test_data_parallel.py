"""Data parallel 2 through the real server: two engines behind one front.

Shared prefixes stay on the engine that cached them (more cache hits than taking turns), each
engine reports its own metrics, outputs match one engine's, and one engine's crash leaves the
other serving while it restarts.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import InProcessServer, ServerProcess, read_metrics
from tiny_checkpoints import make_tiny_checkpoint

HITS = "vllm:prefix_cache_hits_total"
NUM_GROUPS, NUM_REPEATS = 3, 4
PREFIX_TOKENS, SUFFIX_TOKENS = 160, 20  # 10 full blocks of 16 shared, then a request's own
BLOCK_SIZE = 16  # the server's default


def dp_server(model: Path, tmp_path: Path, routing: str) -> ServerProcess:
    return ServerProcess(
        model, tmp_path / f"{routing}.log", "-dp", "2", "--data-parallel-routing", routing
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def one_engine(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    """The same model behind one engine (in this process): the outputs to match."""
    with InProcessServer(tiny_model, tmp_path_factory.mktemp("one") / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def prefix_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with dp_server(tiny_model, tmp_path_factory.mktemp("dp"), "prefix") as server:
        yield server


def complete(url: str, prompt: str, max_tokens: int = 4) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def shared_prefix_workload(url: str) -> float:
    """Groups of prompts sharing a long prefix, interleaved; the prefix-cache hits they made."""
    before = read_metrics(url)[HITS]
    for repeat in range(NUM_REPEATS):
        for group in range(NUM_GROUPS):
            prefix = chr(ord("A") + group) * PREFIX_TOKENS  # one byte token per character
            suffix = "".join(chr(ord("a") + (repeat + i) % 26) for i in range(SUFFIX_TOKENS))
            complete(url, prefix + suffix)
    return read_metrics(url)[HITS] - before


def test_each_engine_reports_its_own_metrics(prefix_server: ServerProcess) -> None:
    metrics = read_metrics(prefix_server.url)
    for engine in ("0", "1"):
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", HITS):
            assert f"{name}{{engine={engine}}}" in metrics
    assert len(prefix_server.worker_pids()) == 2


def test_greedy_outputs_match_one_engine(prefix_server: ServerProcess, one_engine) -> None:
    prompts = ["Hello", "The quick brown fox", "x" * 40, "0123456789"]
    for prompt in prompts:
        assert complete(prefix_server.url, prompt, 12) == complete(one_engine.url, prompt, 12)


def test_shared_prefixes_hit_more_than_taking_turns(
    prefix_server: ServerProcess, tiny_model: Path, tmp_path: Path
) -> None:
    # Past the prefix a request may also share a few tokens of a kept tail (the partly filled
    # last block of an earlier request), by chance: fewer than a block's worth each.
    chance = NUM_GROUPS * NUM_REPEATS * (BLOCK_SIZE - 1)
    prefix_hits = shared_prefix_workload(prefix_server.url)
    # Every repeat after a group's first finds the whole shared prefix cached on its engine.
    expected = NUM_GROUPS * (NUM_REPEATS - 1) * PREFIX_TOKENS
    assert expected <= prefix_hits <= expected + chance
    with dp_server(tiny_model, tmp_path, "round-robin") as turns:
        turns_hits = shared_prefix_workload(turns.url)
    # Taking turns, three interleaved groups visit both engines: each engine computes each
    # prefix once, so two repeats of every group miss.
    expected = NUM_GROUPS * (NUM_REPEATS - 2) * PREFIX_TOKENS
    assert expected <= turns_hits <= expected + chance
    assert prefix_hits > turns_hits


def test_one_engine_crashing_leaves_the_other_serving(prefix_server: ServerProcess) -> None:
    url = prefix_server.url
    victim, survivor = prefix_server.worker_pids()
    os.kill(victim, signal.SIGKILL)
    # The front reaps its dead worker in the same turn of its loop that takes the engine out.
    deadline = time.monotonic() + 10
    while victim in prefix_server.worker_pids():
        assert time.monotonic() < deadline, "the front did not notice its worker's death"
        time.sleep(0.02)  # paces the poll
    for i in range(6):  # served by the survivor while the victim's engine restarts
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        complete(url, f"still serving {i}")
    deadline = time.monotonic() + 120
    while len(workers := prefix_server.worker_pids()) < 2:
        assert time.monotonic() < deadline, "the crashed engine was not restarted"
        time.sleep(0.2)
    assert survivor in workers and victim not in workers
    for i in range(4):  # both engines serve again
        complete(url, f"back {i}" * 20)
