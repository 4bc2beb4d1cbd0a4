"""Another client's first token while an attacker sends the slowest grammars the front allows.

    python -m benchmarks.grammar_attacker [--preset tiny] [--requests 8] [--attackers 1]

Serves a dummy-weight checkpoint of the preset's shape with `nanoserve serve` on 127.0.0.1 (the
user's defaults) and measures, quiet and then under attack, the TTFT of two kinds of victim
request, sent one at a time by another client: a small constrained completion (a regex, new
each time, so it needs a compile of its own) and an unconstrained one. The attacker keeps
`--attackers` requests in flight, each a grammar never seen before (so none is served from
the compile cache) of MAX_GRAMMAR_RULES Lark rules with as many alternatives each as fit in
MAX_CONSTRAINT_BYTES (about 30): the slowest compile the front's bounds let through that we know of
(constraint_limits.py). The goal: the constrained victim's first token within 2 s, and the
unconstrained one's TTFT near its quiet value. Reported: medians and maxima, the ratios under
attack to quiet, and what the attacker's requests got. Results go to
benchmarks/results/<date>-grammar-attacker/.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.data_parallel import serving
from nanoserve.bench.models import make_dummy_checkpoint
from nanoserve.bench.results import results_dir
from nanoserve.server.openai.constraint_limits import MAX_CONSTRAINT_BYTES, MAX_GRAMMAR_RULES

OUTPUT_ROOT = Path(__file__).resolve().parent / "results"
CONSTRAINED_TTFT_GOAL_S = 2.0


def worst_grammar(salt: int) -> str:
    """`start` and MAX_GRAMMAR_RULES - 1 more rules, each of as many alternatives as the byte
    bound allows, every literal salted (a new grammar per salt: no compile is cached)."""
    num_rules = MAX_GRAMMAR_RULES - 1

    def rule(i: int, num_alternatives: int) -> str:
        alternatives = (f'"{salt}_{i}_{j}" r{(i + 1) % num_rules}' for j in range(num_alternatives))
        return f"r{i}: " + " | ".join(alternatives)

    bytes_per_alternative = len(rule(num_rules - 1, 100)) / 100
    num_alternatives = int(MAX_CONSTRAINT_BYTES / num_rules / bytes_per_alternative)
    while True:
        text = "start: r0\n" + "\n".join(rule(i, num_alternatives) for i in range(num_rules))
        if len(text.encode()) <= MAX_CONSTRAINT_BYTES:
            return text
        num_alternatives -= 1


async def ttft(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float]:
    """(status, seconds to the first streamed chunk, or to the answer when not a 200)."""
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, time.perf_counter() - started
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    return 200, first if first is not None else float("nan")


def victim_bodies(kind: str, count: int, offset: int) -> list[dict]:
    """`count` victim requests; constrained ones each with a regex not seen before."""
    bodies = []
    for i in range(offset, offset + count):
        body: dict = {"prompt": f"request {i}:", "max_tokens": 8, "temperature": 0, "stream": True}
        if kind == "constrained":
            body["guided_regex"] = f"v{i}[a-z]{{3,6}}"
        bodies.append(body)
    return bodies


async def victims(url: str, args: argparse.Namespace, offset: int) -> dict[str, list[float]]:
    """TTFTs of the victims, one request at a time, the two kinds alternating."""
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    async with httpx.AsyncClient(timeout=600) as client:
        constrained = victim_bodies("constrained", args.requests, offset)
        free = victim_bodies("unconstrained", args.requests, offset)
        for with_grammar, without in zip(constrained, free, strict=True):
            for kind, body in (("constrained", with_grammar), ("unconstrained", without)):
                status, seconds = await ttft(client, url, body)
                assert status == 200, f"a victim's request got {status}"
                times[kind].append(seconds)
    return times


async def attack(url: str, args: argparse.Namespace, stop: asyncio.Event, log: list) -> None:
    """`--attackers` loops, each sending a new worst grammar as soon as the last is answered."""
    salts = itertools.count()

    async def one_loop(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            body = {"prompt": "x", "max_tokens": 1, "stream": True}
            body["guided_grammar"] = worst_grammar(next(salts))
            log.append(await ttft(client, url, body))

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one_loop(client) for _ in range(args.attackers)))


async def under_attack(url: str, args: argparse.Namespace) -> tuple[dict, list]:
    stop, log = asyncio.Event(), []
    attacker = asyncio.create_task(attack(url, args, stop, log))
    await asyncio.sleep(args.attack_head_start_s)  # the compile slots are taken
    times = await victims(url, args, offset=10_000)
    stop.set()
    await attacker
    return times, log


def summary(quiet: dict, attacked: dict, attacks: list, args: argparse.Namespace) -> dict:
    row: dict = {"requests_per_kind": args.requests, "attackers": args.attackers}
    for kind in ("constrained", "unconstrained"):
        q, a = statistics.median(quiet[kind]), statistics.median(attacked[kind])
        row[kind] = {
            "quiet_median_s": q,
            "quiet_max_s": max(quiet[kind]),
            "attack_median_s": a,
            "attack_max_s": max(attacked[kind]),
            "median_ratio": a / q,
        }
    row["constrained_within_goal"] = sum(
        t <= CONSTRAINED_TTFT_GOAL_S for t in attacked["constrained"]
    )
    statuses = [status for status, _ in attacks]
    row["attack_requests"] = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    row["attack_first_token_median_s"] = (
        statistics.median(t for _, t in attacks) if attacks else None
    )
    return row


def machine() -> dict:
    """CPU model and count (what `lscpu` and `nproc` say)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line]
    model = names[0] if names else "unknown"
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--requests", type=int, default=8, help="victim requests of each kind")
    parser.add_argument("--attackers", type=int, default=1, help="attack requests in flight")
    parser.add_argument("--attack-head-start-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    out = results_dir(OUTPUT_ROOT, "grammar-attacker")
    size = len(worst_grammar(0).encode())
    print(f"worst grammar: {MAX_GRAMMAR_RULES} rules, {size} bytes", flush=True)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_dummy_checkpoint(Path(tmp) / "model", args.preset)
        with serving(model, [], out / "server.log") as url:
            asyncio.run(victims(url, argparse.Namespace(requests=2), offset=-10))  # warm up
            quiet = asyncio.run(victims(url, args, offset=0))
            attacked, attacks = asyncio.run(under_attack(url, args))
    row = summary(quiet, attacked, attacks, args)
    row.update(preset=args.preset, grammar_bytes=size, machine=machine(), load_before=load_before)
    row["load_after"] = os.getloadavg()[0]
    row["raw"] = {"quiet": quiet, "attacked": attacked, "attacks": attacks}
    (out / "results.json").write_text(json.dumps(row, indent=2))
    print(json.dumps({k: v for k, v in row.items() if k != "raw"}, indent=2))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
