"""Command-line arguments of `nanoserve bench`: one group per concern, checked once parsed."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from nanoserve.bench import workloads
from nanoserve.bench.arms import DEFAULT_VLLM_VENV
from nanoserve.bench.background import parse_background_load
from nanoserve.bench.llamacpp import DEFAULT_LLAMACPP_DIR, SLOTS
from nanoserve.bench.models import PRESETS
from nanoserve.cli.help_format import DefaultsHelpFormatter

DESCRIPTION = (
    "Serving benchmark: start each server, send every one the same requests, print one table."
)
DEFAULT_OUTPUT_ROOT = Path("benchmarks") / "results"  # relative to the current directory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check `nanoserve bench` arguments; `--workload all` becomes every workload."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.workload = args.workload or ["scoreboard"]
    if "all" in args.workload:
        args.workload = list(workloads.WORKLOADS)
    args.workload = list(dict.fromkeys(args.workload))
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error(f"--concurrency levels must be ≥ 1, got {args.concurrency}")
    if args.threads is None or args.threads < 1:
        parser.error(f"--threads must be ≥ 1, got {args.threads}")
    if args.rounds < 1:
        parser.error(f"--rounds must be ≥ 1, got {args.rounds}")
    if not 0 <= args.temperature <= 2:
        parser.error(
            f"--temperature must be in [0, 2] (the OpenAI API's range), got {args.temperature}"
        )
    if not 0 <= args.random_range_ratio < 1:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.request_rate <= 0:
        parser.error(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    try:
        args.background_load = parse_background_load(args.background_load)
    except ValueError as error:
        parser.error(str(error))
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nanoserve bench",
        description=DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--workload",
        nargs="+",
        action="extend",
        choices=[*workloads.WORKLOADS, "all"],
        help="one or more workloads, in one flag or repeated; each writes its own results "
        "directory (default: scoreboard)",
    )
    p.add_argument(
        "--arm",
        action="append",
        default=None,
        help="nanoserve | hf | vllm (builds a ~3.4 GB vLLM environment on first use; "
        "--enforce-eager) | vllm-compiled (vLLM as it starts without flags: torch.compile) | "
        "llamacpp "
        "(builds llama.cpp's llama-server on first use; the model converted to a bf16 GGUF) | "
        "url=NAME=http://host:port (a server already running) | cmd=NAME='cmd {port} {model}' "
        "(repeat; default: nanoserve and hf)",
    )
    p.add_argument(
        "--baseline", default=None, help="arm the ratios are against (default: nanoserve)"
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="checkpoint directory every arm loads (default: a dummy checkpoint of --preset)",
    )
    model.add_argument(
        "--preset",
        default="qwen3-0.6b",
        choices=sorted(PRESETS),
        help="shape of the dummy-weight Qwen3 checkpoint",
    )
    model.add_argument(
        "--model-dir",
        default=None,
        help="write (or reuse) the dummy checkpoint here (default: a temporary directory)",
    )
    _add_load_arguments(p)
    _add_workload_arguments(p)
    _add_server_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument(
        "--output-root",
        type=Path,
        default=DEFAULT_OUTPUT_ROOT,
        help="results go to OUTPUT_ROOT/<date>-<workload>/; a relative path is relative to the "
        "current directory",
    )
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def _add_load_arguments(p: argparse.ArgumentParser) -> None:
    load = p.add_argument_group("load")
    load.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    load.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (0: greedy; vLLM bench's flag)",
    )
    load.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="compute threads per arm (default: every CPU, here %(default)s)",
    )
    load.add_argument("--num-warmup", type=int, default=2, help="uncounted requests per workload")
    load.add_argument(
        "--background-load",
        default="none",
        help="a busy machine while each arm is measured: cores=N processes that each keep a core "
        "busy, memory=N that stream memory, or both (cores=1,memory=1)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals; inf sends all at once",
    )
    load.add_argument("--max-concurrency", type=int, default=1, help="shared-prefix concurrency")
    load.add_argument(
        "--request-timeout-s", type=float, default=600.0, help="seconds one request may take"
    )
    load.add_argument(
        "--startup-timeout-s",
        type=float,
        default=900.0,
        help="seconds a server the benchmark starts may take to answer /health (loading a model)",
    )
    load.add_argument(
        "--url-timeout-s",
        type=float,
        default=30.0,
        help="seconds a url= arm (already running) may take to answer /health or /v1/models",
    )
    load.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with R > 1 every server stays up and each round runs every arm in turn (the order "
        "rotating), with per-round prompt prefixes; the table pools all rounds. Needs memory "
        "for all servers at once",
    )


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    board = p.add_argument_group("scoreboard")
    board.add_argument("--scoreboard-prompts", type=int, default=8, help="prompts")
    board.add_argument("--scoreboard-max-tokens", type=int, default=50, help="tokens per reply")
    board.add_argument(
        "--scoreboard-concurrency", type=int, default=8, help="the concurrent phase's level"
    )
    sweep = p.add_argument_group("sweep")
    sweep.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated levels")
    sweep.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    sweep.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="prompt lengths drawn from input-len × [1 - r, 1 + r] (vLLM bench's flag)",
    )
    sweep.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    sweep.add_argument(
        "--num-prompts", type=int, default=None, help="per level (default max(8, 2×concurrency))"
    )
    typing = p.add_argument_group("autocomplete")
    typing.add_argument(
        "--autocomplete-file",
        type=Path,
        default=None,
        help="Python file typed (default: the standard library's textwrap.py)",
    )
    typing.add_argument("--autocomplete-context", type=int, default=256, help="chars typed already")
    typing.add_argument("--autocomplete-chars", type=int, default=120, help="chars to type")
    typing.add_argument("--typing-cps", type=float, default=8.0, help="typing speed, chars/s")
    typing.add_argument(
        "--debounce-ms", type=float, default=50.0, help="pause after a key before a request"
    )
    typing.add_argument("--autocomplete-max-tokens", type=int, default=10, help="per request")
    prefix = p.add_argument_group("shared-prefix")
    prefix.add_argument("--num-groups", type=int, default=4, help="groups of prompts")
    prefix.add_argument("--prompts-per-group", type=int, default=4, help="prompts per group")
    prefix.add_argument("--prefix-len", type=int, default=1000, help="shared prompt tokens")
    prefix.add_argument("--question-len", type=int, default=24, help="distinct tokens per prompt")
    prefix.add_argument("--prefix-output-len", type=int, default=16, help="output tokens")


def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    servers = p.add_argument_group("servers")
    servers.add_argument("--max-model-len", type=int, default=2048, help="passed to vLLM")
    servers.add_argument(
        "--nanoserve-args",
        default="",
        help="extra arguments for nanoserve serve, one string: --nanoserve-args='--enforce-eager'",
    )
    servers.add_argument(
        "--omp-wait-policy",
        choices=["PASSIVE", "ACTIVE"],
        default=None,
        help="OMP_WAIT_POLICY for every arm (default: each server's own choice)",
    )
    servers.add_argument(
        "--vllm-venv",
        type=Path,
        default=DEFAULT_VLLM_VENV,
        help="the vLLM arm's virtual environment, built there on first use",
    )
    servers.add_argument("--vllm-args", default="", help="extra arguments for vLLM (one string)")
    servers.add_argument(
        "--llamacpp-dir",
        type=Path,
        default=DEFAULT_LLAMACPP_DIR,
        help="where the llamacpp arm builds llama-server once (~10 minutes on 2 cores)",
    )
    servers.add_argument(
        "--llamacpp-server",
        type=Path,
        help="a llama-server binary to use (default: one built from llama-cpp-python's source)",
    )
    servers.add_argument(
        "--llamacpp-slots",
        type=int,
        default=SLOTS,
        help="llama-server's --parallel (each slot gets --max-model-len of context); one slot "
        "is an editor's set-up: every request lands where the document is cached",
    )
    servers.add_argument(
        "--llamacpp-args", default="", help="extra arguments for llama-server (one string)"
    )
