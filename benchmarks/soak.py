"""Soak: a long mixed load against one `nanoserve serve`, watching its memory.

    nice -n 10 python -m benchmarks.soak [--duration-s 1800] [--concurrency 8] [--model DIR]

Starts the server (the demo model by default) on 127.0.0.1 with a free port, then keeps
--concurrency clients busy until --duration-s is over, each drawing its next request from a
fixed mix: streamed and plain completions and chat completions of random prompts (many share a
prefix, so the prefix cache fills and evicts), n up to 3, seeded and unseeded sampling, stop
strings, and clients that drop a stream after a few frames or a plain request before its
answer. Every request that is not dropped must answer 200 (a stream: end with `data: [DONE]`
and carry no error frame); anything else is an error.

Every --sample-s the front's and the worker's resident memory (VmRSS) is sampled. The result
(request counts, errors, RSS at the end of the --warmup-s warm-up, at the middle and at the end,
and the growth after warm-up) prints as a table and goes to
benchmarks/results/<date>-soak/results.json with every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from nanoserve.bench.results import results_dir

DEMO_MODEL = Path(__file__).resolve().parents[1] / "nanoserve" / "assets" / "demo"
DEFAULT_OUTPUT_ROOT = Path(__file__).resolve().parent / "results"
WORDS = ["def", "class", "return", "import", "self", "value", "data", "list", "the", "of", "for"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def worker_pid(front_pid: int) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == front_pid:
                return int(entry)
    raise RuntimeError("the server has no worker process")


def start_server(model: Path, port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "nanoserve.cli.main", "serve", "--model", str(model)]
    command += ["--port", str(port), "--log-level", "warning", *extra]
    log = open(log_path, "wb")  # noqa: SIM115 - the server's lifetime
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


class Mix:
    """Draws requests: (kind, path, body, drop_after_frames or None)."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.prefixes = [self.text(200) for _ in range(8)]

    def text(self, num_chars: int) -> str:
        words: list[str] = []
        while sum(map(len, words)) < num_chars:
            words.append(self.random.choice(WORDS))
        return " ".join(words)[:num_chars]

    def prompt(self) -> str:
        head = self.random.choice(self.prefixes) if self.random.random() < 0.5 else ""
        return head + self.text(self.random.randint(5, 300))

    def sampling(self) -> dict:
        body: dict = {"max_tokens": self.random.randint(1, 96)}
        if self.random.random() < 0.5:
            body["temperature"] = 0
        elif self.random.random() < 0.5:
            body.update(temperature=0.8, top_p=0.9, seed=self.random.randint(0, 1000))
        if self.random.random() < 0.2:
            body["n"] = self.random.randint(2, 3)
        if self.random.random() < 0.2:
            body["stop"] = [self.random.choice(WORDS)]
        return body

    def draw(self) -> tuple[str, str, dict, int | None]:
        roll = self.random.random()
        stream = roll < 0.6
        drop = self.random.randint(1, 5) if roll < 0.15 else None  # dropped streams
        if 0.9 <= roll < 0.95:
            drop = 0  # a plain request abandoned before its answer
        body = {**self.sampling(), "stream": stream}
        if self.random.random() < 0.35:
            messages = [{"role": "user", "content": self.prompt()}]
            return ("chat", "/v1/chat/completions", {**body, "messages": messages}, drop)
        return ("completion", "/v1/completions", {**body, "prompt": self.prompt()}, drop)


async def run_one(client: httpx.AsyncClient, url: str, request, counts: Counter) -> None:
    kind, path, body, drop = request
    label = f"{kind}-{'stream' if body['stream'] else 'plain'}"
    if drop == 0:
        try:
            await asyncio.wait_for(client.post(f"{url}{path}", json=body), timeout=0.05)
        except asyncio.TimeoutError:
            counts["dropped plain"] += 1
            return
    try:
        if not body["stream"]:
            response = await client.post(f"{url}{path}", json=body)
            ok = response.status_code == 200 and "choices" in response.json()
            counts[label if ok else f"error {label} {response.status_code}"] += 1
            return
        async with client.stream("POST", f"{url}{path}", json=body) as response:
            frames = 0
            async for line in response.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    counts[label] += 1
                    return
                if line.startswith('data: {"error"'):
                    counts[f"error {label} frame: {line[6:200]}"] += 1
                    return
                frames += 1
                if drop is not None and frames >= drop:
                    counts["dropped stream"] += 1
                    return
            counts[f"error {label} no DONE ({response.status_code})"] += 1
    except httpx.HTTPError as e:
        counts[f"error {label} {type(e).__name__}"] += 1


async def load(url: str, args: argparse.Namespace, counts: Counter, until: float) -> None:
    mix = Mix(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def user() -> None:
            while time.monotonic() < until:
                await run_one(client, url, mix.draw(), counts)

        await asyncio.gather(*(user() for _ in range(args.concurrency)))


async def sample(pids: dict[str, int], every_s: float, until: float, samples: list) -> None:
    started = time.monotonic()
    while time.monotonic() < until:
        row = {"t_s": round(time.monotonic() - started, 1)}
        for name, pid in pids.items():
            row[f"{name}_rss_mb"] = round(rss_bytes(pid) / 2**20, 1)
        samples.append(row)
        await asyncio.sleep(every_s)


def at(samples: list[dict], t_s: float) -> dict:
    """The first sample at or after `t_s`."""
    return next((s for s in samples if s["t_s"] >= t_s), samples[-1])


def summarize(samples: list[dict], counts: Counter, args: argparse.Namespace) -> dict:
    start, end = at(samples, args.warmup_s), samples[-1]
    middle = at(samples, (args.warmup_s + end["t_s"]) / 2)
    summary: dict = {
        "requests": sum(counts.values()),
        "errors": sum(n for k, n in counts.items() if k.startswith("error")),
        "counts": dict(sorted(counts.items())),
    }
    for name in ("front", "worker"):
        key = f"{name}_rss_mb"
        growth = (end[key] - start[key]) / start[key] * 100
        summary[name] = {
            "rss_mb_start": start[key],
            "rss_mb_middle": middle[key],
            "rss_mb_end": end[key],
            "growth_after_warmup_pct": round(growth, 1),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--duration-s", type=float, default=1800)
    parser.add_argument("--warmup-s", type=float, default=120)
    parser.add_argument("--sample-s", type=float, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-root", type=Path, default=DEFAULT_OUTPUT_ROOT)
    parser.add_argument("server_args", nargs="*", help="more `nanoserve serve` flags, after --")
    args = parser.parse_args(argv)
    out = results_dir(args.output_root, "soak")
    port = free_port()
    server = start_server(args.model, port, out / "server.log", args.server_args)
    counts: Counter = Counter()
    samples: list[dict] = []
    try:
        pids = {"front": server.pid, "worker": worker_pid(server.pid)}
        until = time.monotonic() + args.duration_s

        async def both() -> None:
            await asyncio.gather(
                load(f"http://127.0.0.1:{port}", args, counts, until),
                sample(pids, args.sample_s, until, samples),
            )

        asyncio.run(both())
        summary = summarize(samples, counts, args)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    summary.update(argv=sys.argv[1:], machine=os.uname().nodename, cpus=os.cpu_count())
    (out / "results.json").write_text(json.dumps({**summary, "samples": samples}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"results: {out}")
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
