"""The command line: `serve --help` explains every flag; sizes parse; bad settings are one line
and exit code 2 before any worker starts."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.cli.main import build_parser, config_default, parse_bytes
from nanoserve.common.config import EngineConfig


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
        "--trust-request-chat-template", "--max-body-bytes",
        "--max-prompt-chars", "--header-timeout", "--body-timeout", "--send-timeout",
        "--worker-timeout", "--shutdown-timeout", "--data-parallel-size", "-dp",
        "--data-parallel-routing",
    ):  # fmt: skip
        assert flag in text


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--served-model-name", "a", "b"])
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 8000, ["a", "b"])
    assert args.enable_prefix_caching and not args.enforce_eager
    assert not args.trust_request_chat_template and args.max_prompt_chars is None
    assert (args.header_timeout, args.body_timeout, args.send_timeout) == (30, 60, 60)
    assert (args.worker_timeout, args.max_body_bytes) == (30, 32 * 2**20)


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
        (
            ["--max-model-len", "999999"],
            "the model's max_position_embeddings (512); use --max-model-len 512 or less",
        ),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be ≥ 1, got 0"),
        (["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
        (["--header-timeout", "0"], "--header-timeout must be > 0 seconds, got 0"),
        (["--send-timeout", "-1"], "--send-timeout must be > 0 seconds, got -1"),
        (["--max-prompt-chars", "0"], "--max-prompt-chars must be ≥ 1, got 0"),
        (["--max-waiting-requests", "0"], "--max-waiting-requests must be ≥ 1, got 0"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["-dp", "0"], "--data-parallel-size must be ≥ 1, got 0"),
        (["--kv-cache-memory", "1KiB"], "--kv-cache-memory 1MiB would hold it"),
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype: invalid choice: 'int4'"),
        (
            ["--kv-cache-dtype", "fp8", "--compile"],
            "--kv-cache-dtype fp8 does not combine with --compile; use one of them (or add "
            "--enforce-eager)",
        ),
        (
            ["--kv-cache-memory", "64KiB", "--max-model-len", "512", "--kv-cache-dtype", "fp8"],
            "a block of 16 tokens takes 4.0 KiB for this model, and one sequence of "
            "--max-model-len (512) tokens needs 32 blocks",
        ),
        (["--generation-config", "/no/such/dir"], "--generation-config /no/such/dir: not a"),
        (
            ["--kv-cache-memory", "256KiB", "--max-model-len", "512", "--dtype", "float32"],
            "needs 32 blocks",
        ),
    ],
)
def test_bad_settings_fail_in_one_line_before_any_worker_starts(
    tiny_checkpoint: Path, flags: list[str], message: str
) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoserve.cli.main",
            "serve",
            "--model",
            str(tiny_checkpoint),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "worker" not in done.stderr.lower() and time.monotonic() - started < 30


def test_a_generation_config_out_of_range_stops_start_up(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli.main", "serve", "--model", "nanoserve-demo",
         "--generation-config", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "nanoserve serve: temperature must be ≥ 0, got -1"


def test_a_bad_worker_timeout_fails_in_one_line(tiny_checkpoint: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli.main", "serve", "--model", str(tiny_checkpoint),
         "--worker-timeout", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "nanoserve serve: --worker-timeout must be > 0 seconds, got 0.0"


def test_serve_flags_take_their_defaults_from_the_engine_config() -> None:
    args = build_parser().parse_args(["serve"])
    for name in ("max_num_seqs", "block_size", "gpu_memory_utilization", "dtype", "device", "seed"):
        assert getattr(args, name) == config_default(EngineConfig, name)


def run_cli(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanoserve.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_version_and_a_bare_command() -> None:
    from nanoserve import __version__

    assert run_cli("--version").stdout.strip() == f"nanoserve {__version__}"
    bare = run_cli()
    assert bare.returncode == 0
    assert "serve" in bare.stdout and "chat" in bare.stdout and "bench" in bare.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enforce-eager", "true"], "--enforce-eager takes no value, got 'true'"),
        (["--compile", "1", "--port", "9"], "--compile takes no value, got '1'"),
        (["a", "--model", "b"], "the model is given twice ('a' and --model 'b')"),
        (["m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (
            ["m", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
            "argument --speculative-config: speculative method must be one of ngram, suffix, "
            "draft_model, got 'eagle'",
        ),
        (
            ["m", "--speculative-config", "{method: ngram}"],
            "argument --speculative-config: --speculative-config is not valid JSON",
        ),
    ],
)
def test_argument_mistakes_are_reported_against_serve(argv: list[str], message: str) -> None:
    done = run_cli("serve", *argv)
    assert done.returncode == 2
    assert f"nanoserve serve: error: {message}" in done.stderr, done.stderr


def test_a_draft_model_with_another_vocabulary_is_refused_before_loading(tmp_path) -> None:
    from tiny_checkpoints import make_tiny_checkpoint

    target = make_tiny_checkpoint(tmp_path / "target", "qwen3")
    draft = make_tiny_checkpoint(tmp_path / "draft", "qwen3", vocab_size=300)
    spec = f'{{"model": "{draft}", "num_speculative_tokens": 2}}'
    done = run_cli("serve", str(target), "--speculative-config", spec, "--device", "cpu")
    assert done.returncode == 2
    assert "a draft model must share the tokenizer" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_vllm_flags_are_accepted() -> None:
    args = build_parser().parse_args(
        ["serve", "org/m", "--tokenizer", "org/t", "--revision", "v2", "--download-dir", "/d"]
        + ["--trust-remote-code"]
    )
    assert (args.tokenizer, args.revision, args.download_dir) == ("org/t", "v2", "/d")
    assert args.trust_remote_code
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "never code from a checkpoint" in " ".join(help_text.split())


def test_a_missing_model_is_reported_before_torch_is_imported(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from nanoserve.cli.main import main\n"
        f"code = main(['serve', '--model', {str(tmp_path / 'nope')!r}])\n"
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.split() == ["2", "False", "False"], done.stderr
    missing = tmp_path / "nope"
    assert done.stderr.strip() == f"nanoserve serve: model directory '{missing}' does not exist"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line_and_exit_code_2(tiny_checkpoint: Path) -> None:
    from servers import free_port

    done = run_cli(
        "serve", "--model", str(tiny_checkpoint), "--device", "cuda", "--port", str(free_port())
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()  # the front's check: no worker started, nothing logged
    assert line.startswith("nanoserve serve: --device cuda was asked for, but "), done.stderr
    assert "use --device cpu" in line and done.stdout == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modle", "m"], "unrecognized arguments: --modle (did you mean --model?)"),
        (["--max-num-seq", "8", "--tokenzer", "t"], "--tokenzer (did you mean --tokenizer?)"),
        (["--frobnicate"], "--frobnicate (nanoserve serve --help lists them)"),
        (
            ["--dtype", "float64"],
            "argument --dtype: invalid choice: 'float64' (choose from 'auto', 'float32', "
            "'bfloat16', 'float16')",
        ),
        (
            ["--quantization", "fp8"],
            "(choose from int8); an FP8 checkpoint (a quantization_config in its config.json) "
            "needs no flag",
        ),
        (["--port", "99999"], "argument --port: a port is a whole number from 1 to 65535"),
        (["--port", "-5"], "argument --port: a port is a whole number from 1 to 65535, got '-5'"),
        (["--master-port", "0"], "argument --master-port: a port is a whole number from 1"),
    ],
)
def test_a_mistyped_flag_or_value_is_one_line_without_the_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from nanoserve.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("nanoserve serve: error: ") and message in line, line


def test_an_unknown_command_and_a_chat_flag_are_one_line_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from nanoserve.cli.main import main

    for argv, message in (
        (["srve"], "nanoserve: error: argument COMMAND: invalid choice: 'srve'"),
        (["chat", "--urll", "x"], "nanoserve chat: error: unrecognized arguments: --urll x (did"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(message), line


def test_closest_suggests_only_a_clear_favourite() -> None:
    from nanoserve.cli.argument_errors import closest

    assert closest("--modle", ["--model", "--dtype", "--seed"]) == "--model"
    assert closest("--zzz", ["--model", "--dtype"]) is None  # nothing alike
    assert closest("--max-z", ["--max-x", "--max-y"]) is None  # a tie: neither


def test_help_shows_the_body_limit_in_mib_and_blames_no_flag_for_a_weight_copy() -> None:
    help_text = " ".join(subcommand_help("serve").split())
    assert "largest request body, e.g. 64MiB (413 beyond; default: 32MiB)" in help_text
    assert "33554432" not in help_text
    compile_help = help_text.split("--compile ", 1)[1].split(" --quantization", 1)[0]
    assert "torch.compile" in compile_help and "copy" not in compile_help


def subcommand_help(name: str) -> str:
    return build_parser()._subparsers._group_actions[0].choices[name].format_help()


def test_a_mistyped_model_name_is_one_line_naming_the_demo(tmp_path: Path) -> None:
    """Offline, the hub's miss for `nanoserve-dmo` is one line that names the demo model."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli.main", "serve", "--model", "nanoserve-dmo"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("nanoserve serve: could not fetch model 'nanoserve-dmo'"), line
    assert line.endswith("; did you mean 'nanoserve-demo'?"), line
