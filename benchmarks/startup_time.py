"""Start-up of `nanoserve serve` with its defaults: seconds to /health 200 and to a first token.

    python -m benchmarks.startup_time --model ~/.cache/nanoserve/bench-models/qwen3-0.6b
    python -m benchmarks.startup_time --model DIR --cold   # drops the page cache first (root)
    python -m benchmarks.startup_time --model DIR --cold --new-machine   # and builds the kernels

"Cold" empties the kernel's page cache before launching (`echo 3 > /proc/sys/vm/drop_caches`,
needs root), so Python, torch and the weights come from disk; "warm" runs right after.
`--new-machine` also gives the server an empty torch extension directory, so it compiles
nanoserve's C++ CPU kernels as on a machine's first start (the user's own cache is untouched).
The worker picks its own threads (OMP_NUM_THREADS is removed from its environment).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from nanoserve.bench.arms import free_port


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no /health 200 within {timeout_s} s")


def measure(model: str, timeout_s: float, new_machine: bool) -> tuple[float, float]:
    """(seconds to /health 200, seconds to a one-token completion), from launch."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if new_machine:
        env["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="nanoserve-kernels-")
    argv = [
        sys.executable,
        "-m",
        "nanoserve.cli.main",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
    ]
    started = time.monotonic()
    process = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout_s)
        ready_s = time.monotonic() - started
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": "hello world", "max_tokens": 1}
        httpx.post(url + "/v1/completions", json=body, timeout=timeout_s).raise_for_status()
        return ready_s, time.monotonic() - started
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        if new_machine:
            shutil.rmtree(env["TORCH_EXTENSIONS_DIR"], ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory or preset name")
    parser.add_argument("--cold", action="store_true", help="drop the page cache first (root)")
    parser.add_argument(
        "--new-machine",
        action="store_true",
        help="an empty torch extension cache: the server compiles its CPU kernels",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="default: 300")
    args = parser.parse_args()
    if args.cold:
        drop_page_cache()
    ready_s, first_token_s = measure(args.model, args.timeout_s, args.new_machine)
    label = ("cold" if args.cold else "warm") + (", kernels compiled" if args.new_machine else "")
    print(f"{label}: /health 200 after {ready_s:.1f} s, first token after {first_token_s:.1f} s")


if __name__ == "__main__":
    main()
