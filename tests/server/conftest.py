"""Server fixtures: real server processes, shared per session where possible."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cycle_model import make_cycle_checkpoint
from servers import API_KEY, ServerProcess
from tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 checkpoint (byte tokenizer, 1024 positions)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", max_position_embeddings=1024
    )


@pytest.fixture(scope="session")
def hf_model(tiny_model: Path):
    """transformers' copy of the tiny model: the oracle for logits and logprobs."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


@pytest.fixture(scope="session")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose greedy output spells CYCLE_TEXT over and over."""
    return make_cycle_checkpoint(tmp_path_factory.mktemp("cycle"))


def _serve(model: Path, tmp_path_factory: pytest.TempPathFactory, *args: str):
    server = ServerProcess(model, tmp_path_factory.mktemp("log") / "server.log", *args)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared server: random tiny model, served as `tiny` and `tiny-alias`."""
    yield from _serve(tiny_model, tmp_path_factory, "--served-model-name", "tiny", "tiny-alias")


@pytest.fixture(scope="session")
def cycle_server(
    cycle_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server of the cycle model that requires API_KEY."""
    yield from _serve(
        cycle_model, tmp_path_factory, "--served-model-name", "cycle", "--api-key", API_KEY
    )


@pytest.fixture(scope="session")
def trusting_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Takes chat templates from requests; short context, so any generation is quick (fuzzing)."""
    yield from _serve(
        tiny_model, tmp_path_factory, "--trust-request-chat-template", "--max-model-len", "64"
    )


@pytest.fixture(scope="session")
def strict_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One-second header, body and send timeouts."""
    yield from _serve(
        tiny_model, tmp_path_factory,
        "--header-timeout", "1", "--body-timeout", "1", "--send-timeout", "1",
    )  # fmt: skip
