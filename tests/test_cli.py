"""The command line: `serve --help` explains every flag; sizes parse."""

from __future__ import annotations

import argparse

import pytest

from nanoserve.cli import build_parser, parse_bytes


def test_serve_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--model", "--host", "--port", "--served-model-name", "--api-key", "--max-model-len",
        "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory",
        "--gpu-memory-utilization", "--dtype", "--device", "--load-format", "--log-level",
        "--chat-template", "--max-waiting-requests", "--no-enable-prefix-caching",
        "--enforce-eager",
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
