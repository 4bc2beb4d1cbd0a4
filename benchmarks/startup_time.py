"""Start-up, side by side: seconds from launch to /health 200 and to a first token, for
nanoserve and its peers, on a first start (page cache emptied) and a warm one.

    python -m benchmarks.startup_time --model ~/.cache/nanoserve/bench-models/qwen3-0.6b
    python -m benchmarks.startup_time --model DIR --arm nanoserve --arm llamacpp \\
        --arm vllm-compiled --rounds 2
    python -m benchmarks.startup_time --model DIR --arm nanoserve --arm llamacpp --new-install

Three stages, as a user meets them:
- **new install**: the one-time work after `pip install` before the first start can begin, timed
  into a fresh directory (`--new-install`): nanoserve compiles its C++ CPU kernels (what
  `scripts/install.sh` does), llama.cpp builds `llama-server` from its source package and
  converts the checkpoint to GGUF, vLLM installs its CPU wheel and dependencies (gigabytes).
- **first start**: the kernel's page cache emptied (`echo 3 > /proc/sys/vm/drop_caches`, root),
  so Python, the libraries and the weights come from disk.
- **warm start**: again, at once.

Each arm starts with its defaults, as `nanoserve bench` starts it (arms.py); rounds alternate the
arms. Every arm computes on every core (OMP_NUM_THREADS = cores, what nanoserve's worker picks
itself on a small machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nanoserve.bench.arms import ArmOptions, ArmSpec, Server, ensure_vllm_venv, parse_arm
from nanoserve.bench.llamacpp import ensure_gguf, ensure_llama_server

ARM_KINDS = ("nanoserve", "llamacpp", "vllm", "vllm-compiled")


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def measure_start(spec: ArmSpec, model_dir: Path, options: ArmOptions) -> tuple[float, float]:
    """(seconds to ready, seconds to a one-token completion), both from launch."""
    server = Server(spec, model_dir, options)
    started = time.monotonic()
    try:
        server.start()
        ready_s = time.monotonic() - started
        body = {"model": server.served_model, "prompt": "hello world", "max_tokens": 1}
        response = httpx.post(
            server.base_url + "/v1/completions", json=body, timeout=options.startup_timeout_s
        )
        response.raise_for_status()
        return ready_s, time.monotonic() - started
    finally:
        server.stop()


def new_install_s(kind: str, model_dir: Path) -> float:
    """Seconds of an arm's one-time work after its package is installed, into a fresh place."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"startup-{kind}-") as scratch:
        if kind == "nanoserve":
            from nanoserve.platforms.cpu.kernels import load_or_build

            load_or_build(Path(scratch) / "cpu_kernels")
        elif kind == "llamacpp":
            ensure_llama_server(Path(scratch))
            copy = Path(scratch) / "model"
            copy.mkdir()
            for item in model_dir.iterdir():  # a GGUF beside the original is not rewritten
                if item.suffix != ".gguf":
                    (copy / item.name).symlink_to(item)
            ensure_gguf(copy, Path(scratch))
        else:
            ensure_vllm_venv(Path(scratch) / "venv")
    return time.monotonic() - started


def run_rounds(args: argparse.Namespace, specs: list[ArmSpec], options: ArmOptions) -> dict:
    """{arm: {"first": [(ready, token)], "warm": [...]}}, arms alternating within a round."""
    times: dict[str, dict[str, list[tuple[float, float]]]] = {
        s.name: {"first": [], "warm": []} for s in specs
    }
    for round_index in range(args.rounds):
        for spec in specs:
            for stage in ("first", "warm"):
                if stage == "first":
                    drop_page_cache()
                ready_s, token_s = measure_start(spec, args.model, options)
                times[spec.name][stage].append((ready_s, token_s))
                print(
                    f"round {round_index + 1} {spec.name} {stage} start: ready {ready_s:.1f} s, "
                    f"first token {token_s:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return times


def report(times: dict, installs: dict[str, float]) -> str:
    """A markdown table of medians over the rounds."""
    lines = [
        "| arm | new install s | first start: ready s | first token s "
        "| warm start: ready s | first token s |",
        "|---|---|---|---|---|---|",
    ]
    for name, stages in times.items():
        cells = [f"{installs[name]:.1f}" if name in installs else "not measured"]
        for stage in ("first", "warm"):
            cells += [f"{statistics.median(t[i] for t in stages[stage]):.1f}" for i in (0, 1)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--arm", action="append", choices=ARM_KINDS, help="default: nanoserve")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--new-install", action="store_true", help="time each arm's set-up")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per start; default 600")
    args = parser.parse_args()
    args.model = args.model.expanduser()
    specs = [parse_arm(kind) for kind in args.arm or ["nanoserve"]]
    options = ArmOptions(
        threads=os.cpu_count() or 1,
        max_model_len=2048,
        startup_timeout_s=args.timeout_s,
        log_dir=Path("benchmarks/results/startup"),
        nanoserve_args=["--max-model-len", "2048"],
    )
    if "llamacpp" in (s.kind for s in specs):  # built and converted before any clock runs
        ensure_gguf(args.model, options.llamacpp_dir)
    installs = {}
    if args.new_install:
        for spec in specs:
            installs[spec.name] = new_install_s(spec.kind, args.model)
            print(f"{spec.name} new install: {installs[spec.name]:.1f} s", file=sys.stderr)
    print(report(run_rounds(args, specs, options), installs))


if __name__ == "__main__":
    main()
