"""Speculative decoding seen from outside: the same greedy text, stop strings, n > 1,
logprobs and structured output as without it, and vLLM's spec_decode counters on /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pinned_step_costs import pin_free_verify_steps
from servers import InProcessServer, read_metrics

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
PROMPT = "The cycle: "


@pytest.fixture(scope="module")
def plain(cycle_model: Path, tmp_path_factory) -> Iterator[InProcessServer]:
    log = tmp_path_factory.mktemp("plain") / "server.log"
    with InProcessServer(cycle_model, log, "--served-model-name", "m") as server:
        yield server


@pytest.fixture(scope="module")
def speculative(cycle_model: Path, tmp_path_factory) -> Iterator[InProcessServer]:
    log = tmp_path_factory.mktemp("speculative") / "server.log"
    flags = ("--served-model-name", "m", "--speculative-config", NGRAM)
    with InProcessServer(cycle_model, log, *flags) as server:
        assert server.client is not None
        pin_free_verify_steps(server.client.engine)  # every step drafts: verification is tested
        yield server


def complete(server: InProcessServer, **fields) -> dict:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 60, "temperature": 0} | fields
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_text_stop_strings_and_n_are_unchanged(plain, speculative):
    for fields in ({}, {"stop": ["世"]}, {"n": 2}, {"max_tokens": 7}):
        expected, got = complete(plain, **fields), complete(speculative, **fields)
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in expected["choices"]]
        assert got["usage"] == expected["usage"]
        assert [c["finish_reason"] for c in got["choices"]] == [
            c["finish_reason"] for c in expected["choices"]
        ]


def test_logprobs_of_accepted_tokens_are_the_targets(plain, speculative):
    expected = complete(plain, logprobs=2)["choices"][0]["logprobs"]
    got = complete(speculative, logprobs=2)["choices"][0]["logprobs"]
    assert got["tokens"] == expected["tokens"]
    assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-4)


def test_constrained_requests_keep_their_grammar(plain, speculative):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fields = {"max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema}}}  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "temperature": 0}
    answers = []
    for server in (plain, speculative):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body | fields, timeout=120)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]
    assert isinstance(json.loads(answers[1])["a"], int)


def test_spec_decode_counters_count_drafts_and_acceptances(speculative):
    before = read_metrics(speculative.url)
    complete(speculative, max_tokens=80)
    after = read_metrics(speculative.url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    drafts = grew("vllm:spec_decode_num_drafts_total")
    drafted = grew("vllm:spec_decode_num_draft_tokens_total")
    accepted = grew("vllm:spec_decode_num_accepted_tokens_total")
    per_position = [
        grew(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}")
        for i in range(4)
    ]
    assert drafts > 0 and 0 < accepted <= drafted <= 4 * drafts
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # position i needs all before it
    # Accepted drafts are tokens the forward passes did not have to generate one by one.
    assert grew("vllm:generation_tokens_total") == 80
