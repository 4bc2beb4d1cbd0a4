"""Data parallel 2 against 1 on a shared-prefix workload: prefix-cache hit rate and TTFT.

    python -m benchmarks.data_parallel [--preset qwen3-0.6b] [--groups 5] [--per-group 5]

Serves one dummy-weight checkpoint of the preset's shape three ways, each with the defaults a
user gets (the worker's own thread choice): one engine, two engines routed by prefix (the
default routing), and two engines taking turns (`--data-parallel-routing round-robin`, the
baseline that ignores prefixes). Each arm gets the same requests: `--groups` system prompts of
`--prefix-len` tokens, each followed by `--per-group` questions of their own, sent groups
interleaved (a prompt of every group, then the next of every group, ...) by `--concurrency`
streaming clients. Reported per arm: the hit rate (prefix-cache hits / prompt tokens looked up,
from /metrics), TTFT p50 and p90 for every request and for the non-first requests of a group
(those that can hit), and the wall time. Results go to benchmarks/results/<date>-data-parallel/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.bench.arms import free_port
from nanoserve.bench.models import make_dummy_checkpoint
from nanoserve.bench.results import results_dir

ARMS = {
    "dp1": [],
    "dp2-prefix": ["-dp", "2"],
    "dp2-round-robin": ["-dp", "2", "--data-parallel-routing", "round-robin"],
}
OUTPUT_ROOT = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def serving(model: Path, flags: list[str], log_path: Path) -> Iterator[str]:
    """`nanoserve serve` with the user's defaults plus `flags`; yields its URL once healthy."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "nanoserve.cli.main",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        *flags,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _is_healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def prefix_cache_counts(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, tokens found) in the prefix cache, summed over the engines."""
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


def make_prompts(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(group, prompt) pairs, groups interleaved; one byte token per character."""
    rng = random.Random(args.seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    prefixes = ["".join(rng.choices(letters, k=args.prefix_len)) for _ in range(args.groups)]
    return [
        (group, f"{prefixes[group]}\nQ{turn}: {''.join(rng.choices(letters, k=32))}\nA:")
        for turn in range(args.per_group)
        for group in range(args.groups)
    ]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> float:
    """TTFT in seconds of one streamed completion (read to the end)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - started
    assert ttft is not None
    return ttft


async def run_load(url: str, prompts: list[tuple[int, str]], args) -> list[tuple[int, float]]:
    queue = list(enumerate(prompts))
    results: list[tuple[int, float]] = []
    seen_groups: set[int] = set()
    first_of_group = set()
    for index, (group, _) in queue:
        if group not in seen_groups:
            first_of_group.add(index)
            seen_groups.add(group)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            index, (_, prompt) = queue.pop(0)
            ttft = await one_request(client, url, prompt, args.max_tokens)
            results.append((int(index in first_of_group), ttft))

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    return results


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if values else 0.0


def run_arm(name: str, flags: list[str], model: Path, prompts, args, log_dir: Path) -> dict:
    print(f"[{name}] starting the server", flush=True)
    with serving(model, flags, log_dir / f"{name}.log") as url:
        asyncio.run(run_load(url, [(0, "warm up " * 8)] * 2, args))
        queries_before, hits_before = prefix_cache_counts(url)
        started = time.perf_counter()
        results = asyncio.run(run_load(url, prompts, args))
        wall_s = time.perf_counter() - started
        queries_after, hits_after = prefix_cache_counts(url)
    queries, hits = queries_after - queries_before, hits_after - hits_before
    every = [t for _, t in results]
    rest = [t for is_first, t in results if not is_first]
    row = {
        "arm": name,
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": 1000 * percentile(every, 50),
        "ttft_p90_ms": 1000 * percentile(every, 90),
        "ttft_rest_p50_ms": 1000 * percentile(rest, 50),
        "wall_s": wall_s,
    }
    print(f"[{name}] {json.dumps(row)}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    # An odd number of groups: with an even one, taking turns between two engines would send
    # every group to the same engine each time, as prefix routing does.
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--per-group", type=int, default=5)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts = make_prompts(args)
    out = results_dir(OUTPUT_ROOT, "data-parallel")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_dummy_checkpoint(Path(tmp) / "model", args.preset)
        rows = [run_arm(name, flags, model, prompts, args, out) for name, flags in ARMS.items()]
    base = rows[0]
    print(
        f"\n{len(prompts)} requests, {args.groups} groups x {args.per_group}, prefix "
        f"{args.prefix_len} tokens, {args.max_tokens} tokens out, concurrency "
        f"{args.concurrency}, {args.preset} shape (dummy weights)\n"
    )
    print(
        "| arm | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p50, non-first ms | wall s "
        "| wall vs dp1 |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p90_ms']:.0f} | {r['ttft_rest_p50_ms']:.0f} | {r['wall_s']:.1f} | "
            f"{r['wall_s'] / base['wall_s']:.2f} |"
        )
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
