"""Default sampling parameters from the model's generation_config.json (`--generation-config
auto`, vLLM's default): fields a request leaves unset take the model's, set ones win."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from servers import InProcessServer

from nanoserve.text.tokenizer import load_tokenizer

# Greedy by default, a strong repetition penalty, 5 new tokens unless the request says more.
DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.8, "max_new_tokens": 5}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def defaults_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    model_dir = tmp_path_factory.mktemp("with_defaults") / "model"
    shutil.copytree(tiny_model, model_dir)
    config_path = model_dir / "generation_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **DEFAULTS}))
    server = InProcessServer(model_dir, tmp_path_factory.mktemp("log") / "server.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def greedy_reference(hf_model, token_ids: list[int], num_tokens: int, penalty: float) -> list[int]:
    """transformers' greedy tokens with a repetition penalty (the oracle)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([token_ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
            do_sample=False, repetition_penalty=penalty, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(token_ids) :].tolist()


def completion_text(server: InProcessServer, body: dict) -> str:
    body = {"prompt": PROMPT, "ignore_eos": True, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_unset_fields_take_the_model_defaults(defaults_server, tiny_model, hf_model):
    tokenizer = load_tokenizer(tiny_model)
    # Completions' max_tokens has OpenAI's default, 16, which (as in vLLM) is not unset.
    expected = greedy_reference(hf_model, tokenizer(PROMPT)["input_ids"], 16, 1.8)
    got = completion_text(defaults_server, {})  # no temperature, penalty or max_tokens
    assert got == tokenizer.decode(expected, skip_special_tokens=True)
    explicit = {"temperature": 0, "repetition_penalty": 1.8, "max_tokens": 16}
    assert completion_text(defaults_server, explicit) == got


def test_fields_a_request_sets_win_over_the_defaults(defaults_server, tiny_model, hf_model):
    tokenizer = load_tokenizer(tiny_model)
    expected = greedy_reference(hf_model, tokenizer(PROMPT)["input_ids"], 9, 1.0)
    got = completion_text(defaults_server, {"repetition_penalty": 1.0, "max_tokens": 9})
    assert got == tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_without_max_tokens_stops_at_the_models_max_new_tokens(defaults_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = httpx.post(f"{defaults_server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == DEFAULTS["max_new_tokens"]
