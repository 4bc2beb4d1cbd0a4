"""The command line: `serve --help` explains every flag; sizes parse; bad settings are one line
and exit code 2 before any worker starts."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.cli import build_parser, config_default, parse_bytes
from nanoserve.config import EngineConfig
from nanoserve.testing import make_tiny_checkpoint


def test_serve_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--model", "--host", "--port", "--served-model-name", "--api-key", "--max-model-len",
        "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory",
        "--gpu-memory-utilization", "--dtype", "--device", "--load-format", "--log-level",
        "--chat-template", "--max-waiting-requests", "--no-enable-prefix-caching",
        "--enforce-eager", "--tool-call-parser", "--enable-auto-tool-choice",
    ):  # fmt: skip
        assert flag in text


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--served-model-name", "a", "b"])
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 8000, ["a", "b"])
    assert args.enable_prefix_caching and not args.enforce_eager


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1024", 1024), ("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1e9", 10**9), ("2k", 2000)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "0"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-size", "3"], "--block-size must be a power of two ≥ 1, got 3"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be ≥ 1, got 0"),
        (["--max-model-len", "999999"], "--max-model-len (999999) is larger than the model's"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be ≥ 1, got 0"),
        (["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ],
)
def test_bad_settings_fail_in_one_line_before_any_worker_starts(
    tiny_checkpoint: Path, flags: list[str], message: str
) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", "serve", "--model", str(tiny_checkpoint), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "worker" not in done.stderr.lower() and time.monotonic() - started < 30


def test_serve_flags_take_their_defaults_from_the_engine_config() -> None:
    args = build_parser().parse_args(["serve"])
    for name in ("max_num_seqs", "block_size", "gpu_memory_utilization", "dtype", "device", "seed"):
        assert getattr(args, name) == config_default(EngineConfig, name)
