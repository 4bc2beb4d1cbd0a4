"""The first requests after a `--compile` server says ready: do they wait for a compile?

Starts `nanoserve serve --compile` (the nanoserve this Python imports) on a free port, waits
for /health, then times, one after another: one greedy completion alone, then two at once
(32 tokens each, so that decoding crosses from one KV block into more). Prints one JSON line.

    python -m benchmarks.compile_first_request [--model nanoserve-demo] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_completion(url: str, prompt: str, max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    response.raise_for_status()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nanoserve-demo", help="model to serve")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "nanoserve.cli.main", "serve", "--model", args.model]
    command += ["--port", str(port), "--compile", "--log-level", "warning"]
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if server.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"the server exited:\n{log.read().decode()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            ready_s = time.perf_counter() - started
            alone_s = timed_completion(url, "def fibonacci(n):", args.max_tokens)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                started_pair = time.perf_counter()
                prompts = ["import os\n", "class Stack:"]
                list(pool.map(lambda p: timed_completion(url, p, args.max_tokens), prompts))
                pair_s = time.perf_counter() - started_pair
            steady_s = timed_completion(url, "def fibonacci(n):", args.max_tokens)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    result = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "ready_s": round(ready_s, 1),
        "first_request_alone_s": round(alone_s, 2),
        "first_pair_s": round(pair_s, 2),
        "same_request_again_s": round(steady_s, 2),
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
