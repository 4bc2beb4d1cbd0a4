"""Tensor parallelism through the real server on CPU (gloo): two ranks give one rank's greedy
tokens; a dead rank brings the group down and it comes back; two "machines" on loopback serve
one model."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from servers import ServerProcess, free_port, read_metrics
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 3], [250, 42, 7, 8, 9, 11, 13, 200, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp"), "qwen3", max_position_embeddings=512)


@pytest.fixture(scope="module")
def one_rank(checkpoint: Path) -> LLM:
    """The model on one rank, in-process: the reference."""
    return LLM(str(checkpoint), dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def expected(one_rank: LLM) -> list[tuple[str, list[float]]]:
    """One rank's greedy text and its tokens' logprobs."""
    llm = one_rank
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return [
        (o.text, [p[t].logprob for p, t in zip(o.logprobs, o.token_ids, strict=True)])
        for o in outputs
    ]


def assert_greedy_matches(url: str, expected: list[tuple[str, list[float]]]) -> None:
    for prompt, (text, logprobs) in zip(PROMPTS, expected, strict=True):
        greedy = {"temperature": 0, "ignore_eos": True, "logprobs": 0}
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, **greedy}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == text
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)


def assert_prompt_logprobs_match(url: str, llm: LLM) -> None:
    """Scoring a prompt makes rank 0 gather logits of prompt rows: the followers must follow."""
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [output] = llm.generate([prompt], params)
    expected = [None] + [
        entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
    ]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and got[1:] == pytest.approx(expected[1:], abs=1e-4)


def wait_status(url: str, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health did not answer {status} within {timeout_s} s")


def test_two_ranks_give_one_ranks_tokens_and_survive_a_dead_rank(
    checkpoint, one_rank, expected, tmp_path
):
    with ServerProcess(checkpoint, tmp_path / "server.log", "-tp", "2") as server:
        ranks = server.worker_pids()
        assert len(ranks) == 2  # the front started both ranks
        assert_greedy_matches(server.url, expected)
        assert_prompt_logprobs_match(server.url, one_rank)

        os.kill(server.worker_pids()[-1], signal.SIGKILL)  # rank 1 dies
        wait_status(server.url, 503, timeout_s=30)  # the group is down: not ready
        wait_status(server.url, 200, timeout_s=180)  # and restarted as a whole
        assert len(server.worker_pids()) == 2 and not set(server.worker_pids()) & set(ranks)
        assert_greedy_matches(server.url, expected)


def test_two_machines_on_loopback_serve_one_model(checkpoint, expected, tmp_path):
    port = str(free_port())
    group = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    headless = ["--headless", "--node-rank", "1", *group]
    node1 = ServerProcess(checkpoint, tmp_path / "node1.log", *headless)
    try:
        with ServerProcess(checkpoint, tmp_path / "node0.log", "--node-rank", "0", *group) as node0:
            assert len(node0.worker_pids()) == 1  # node 0 runs rank 0 only
            assert_greedy_matches(node0.url, expected)
    finally:
        node1.stop()


def test_two_ranks_verify_drafts_as_one_rank_decodes(checkpoint, expected, tmp_path):
    """A verify step (k + 1 rows per request) is broadcast and followed like any other."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    flags = ("-tp", "2", "--speculative-config", spec)
    with ServerProcess(checkpoint, tmp_path / "server.log", *flags) as server:
        assert_greedy_matches(server.url, expected)
        drafted = read_metrics(server.url)["vllm:spec_decode_num_draft_tokens_total"]
        assert drafted > 0
