"""Server fixtures, shared per session where possible: the real app in this process against a
real engine (`InProcessServer`), and one real `nanoserve serve` process for what is about the
front process itself and its workers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cycle_model import make_cycle_checkpoint
from servers import API_KEY, InProcessServer, ServerProcess
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


@contextmanager
def serving_in_process(
    model: Path | str, tmp_path_factory: pytest.TempPathFactory, *args: str
) -> Iterator[InProcessServer]:
    """An in-process server of `model` with `serve`'s flags, stopped however the test ends."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    with InProcessServer(model, log, *args) as server:
        yield server


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    """The shared server: random tiny model, served as `tiny` and `tiny-alias`, in float32 (in
    bfloat16 a random model's near ties round apart between batch shapes, so two greedy runs of
    one prompt could differ)."""
    names = ("--served-model-name", "tiny", "tiny-alias")
    with serving_in_process(tiny_model, tmp_path_factory, *names, "--dtype", "float32") as server:
        yield server


@pytest.fixture(scope="session")
def cycle_server(
    cycle_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    """A server of the cycle model that requires API_KEY."""
    with serving_in_process(
        cycle_model, tmp_path_factory, "--served-model-name", "cycle", "--api-key", API_KEY
    ) as server:
        yield server


@pytest.fixture(scope="session")
def trusting_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    """Takes chat templates from requests; short context, so any generation is quick (fuzzing)."""
    with serving_in_process(
        tiny_model, tmp_path_factory, "--trust-request-chat-template", "--max-model-len", "64"
    ) as server:
        yield server


@pytest.fixture(scope="session")
def strict_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    """One-second header, body and send timeouts."""
    timeouts = ("--header-timeout", "1", "--body-timeout", "1", "--send-timeout", "1")
    with serving_in_process(tiny_model, tmp_path_factory, *timeouts) as server:
        yield server


@pytest.fixture(scope="session")
def front_process(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A real `nanoserve serve` of the tiny model, shared by the tests of the front process
    itself (its memory) and of its workers' deaths: it replaces a worker that dies or is silent
    for 2 s, and is healthy again when such a test ends."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    with ServerProcess(tiny_model, log, "--worker-timeout", "2") as server:
        yield server
