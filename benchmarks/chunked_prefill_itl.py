"""Inter-token latency of running streams while a long prompt arrives, chunked prefill vs not.

    python -m benchmarks.chunked_prefill_itl [--budget 256] [--streams 4] [--long-len 2000]
        [--repeats 3] [--threads 2] [--model DIR]

Two nanoserve servers in turn, on a dummy-weight Qwen3 `tiny` checkpoint (nanoserve.bench.models,
byte tokenizer: 1 character = 1 token) or --model: `chunked` (--max-num-batched-tokens --budget)
and `unchunked` (--max-num-batched-tokens 4096: the whole long prompt runs in one step). For each:

    A  --streams concurrent streamed greedy completions (ignore_eos, --max-tokens each), no
       other load: the gaps between text chunks (ITL) of all streams.
    B  the same streams; once every stream has --lead-tokens tokens, one --long-len prompt
       (max_tokens 1, streamed) is sent. ITL of the streams over the window from its send to its
       [DONE] (a gap counts when it ends inside the window), over the whole phase, and the long
       request's time to first token.

Each phase runs --repeats times on fresh random texts (no prefix-cache hits). Goal (issue 6): with
chunked prefill, p99 ITL in the window ≤ 2x p99 ITL of phase A. Results go to
benchmarks/results/<date>-chunked-prefill/ (results.json, results.md, server logs).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from nanoserve.bench.arms import ArmOptions, ArmSpec, Server
from nanoserve.bench.client import RequestResult, completion_body, make_client, stream_completion
from nanoserve.bench.metrics import distribution_ms
from nanoserve.bench.models import make_dummy_checkpoint
from nanoserve.bench.results import results_dir
from nanoserve.bench.workloads import PromptMaker

RESULTS_ROOT = Path(__file__).resolve().parent / "results"  # benchmarks/results
MODEL_CACHE = Path.home() / ".cache" / "nanoserve" / "bench-models"
MAX_MODEL_LEN = 4096
GOAL_RATIO = 2.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def arrival_times(result: RequestResult, t0: float) -> list[float]:
    """perf_counter time of each text chunk: the first at TTFT, then the ITL gaps summed."""
    if result.ttft_s is None:
        return []
    times = [t0 + result.sent_s + result.ttft_s]
    for gap in result.itl_s:
        times.append(times[-1] + gap)
    return times


async def run_round(
    url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    long_prompt: str | None,
    lead_tokens: int,
) -> dict:
    """One phase A (long_prompt None) or B round: gaps (end time, length) of every stream."""
    streams = [RequestResult(index=i) for i in range(len(prompts))]
    long = RequestResult(index=-1)
    window = None
    async with make_client(600.0) as client:
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(
                stream_completion(client, url, completion_body(model, p, max_tokens, True), r, t0)
            )
            for p, r in zip(prompts, streams, strict=True)
        ]
        if long_prompt is not None:
            while any(len(r.itl_s) + 1 < lead_tokens for r in streams):
                if all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.002)
            body = completion_body(model, long_prompt, 1, True)
            await stream_completion(client, url, body, long, t0)
            window = (t0 + long.sent_s, t0 + long.sent_s + (long.e2e_s or 0.0))
        await asyncio.gather(*tasks)
    errors = [r.error for r in [*streams, long] if r.error]
    if errors:
        raise RuntimeError(f"request failed: {errors[0]}")
    gaps = []  # (end time, gap) over all streams
    for r in streams:
        times = arrival_times(r, t0)
        gaps += [(end, end - start) for start, end in zip(times, times[1:], strict=False)]
    in_window = [g for end, g in gaps if window and window[0] <= end <= window[1]]
    still_running = window and all(arrival_times(r, t0)[-1] > window[1] for r in streams)
    return {
        "all_gaps_s": [g for _, g in gaps],
        "window_gaps_s": in_window,
        "long_ttft_s": long.ttft_s if long_prompt is not None else None,
        "long_prompt_tokens": long.prompt_tokens,
        "streams_outlived_window": bool(still_running) if long_prompt is not None else None,
    }


def run_config(
    name: str,
    budget: int,
    args: argparse.Namespace,
    model_dir: Path,
    maker: PromptMaker,
    out_dir: Path,
) -> dict:
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(budget)]
    flags += ["--compile"] if args.compile else []
    options = ArmOptions(
        threads=args.threads,
        max_model_len=MAX_MODEL_LEN,
        startup_timeout_s=600,
        log_dir=out_dir,
        nanoserve_args=flags,
    )
    server = Server(ArmSpec(name=name, kind="nanoserve"), model_dir, options)
    log(f"{name}: starting server (--max-num-batched-tokens {budget})")
    server.start()
    url = server.base_url + "/v1/completions"
    try:

        def short() -> list[str]:
            return [maker.random_text(args.prompt_len) for _ in range(args.streams)]

        log(f"{name}: warm-up")
        for _ in range(2):
            asyncio.run(
                run_round(
                    url, server.served_model, short(), 32, maker.random_text(args.long_len), 4
                )
            )
        rounds: dict[str, list[dict]] = {"A": [], "B": []}
        for i in range(args.repeats):  # A and B alternate, so background load hits both
            for phase in ("A", "B"):
                long_prompt = maker.random_text(args.long_len) if phase == "B" else None
                r = asyncio.run(
                    run_round(
                        url,
                        server.served_model,
                        short(),
                        args.max_tokens,
                        long_prompt,
                        args.lead_tokens,
                    )
                )
                rounds[phase].append(r)
                extra = ""
                if phase == "B":
                    extra = (
                        f", long TTFT {r['long_ttft_s'] * 1000:.0f} ms, "
                        f"{len(r['window_gaps_s'])} gaps in window"
                    )
                log(f"{name}: phase {phase} round {i + 1}/{args.repeats} done{extra}")
    finally:
        server.stop()
    a_itl = distribution_ms([g for r in rounds["A"] for g in r["all_gaps_s"]])
    b_win = distribution_ms([g for r in rounds["B"] for g in r["window_gaps_s"]])
    return {
        "config": name,
        "max_num_batched_tokens": budget,
        "command": server.description["command"],
        "itl_ms_no_long": a_itl,
        "itl_ms_long_window": b_win,
        "itl_ms_long_overall": distribution_ms([g for r in rounds["B"] for g in r["all_gaps_s"]]),
        "num_gaps_no_long": sum(len(r["all_gaps_s"]) for r in rounds["A"]),
        "num_gaps_window": sum(len(r["window_gaps_s"]) for r in rounds["B"]),
        "p99_ratio": b_win["p99"] / a_itl["p99"] if b_win["p99"] and a_itl["p99"] else None,
        "long_ttft_ms": [r["long_ttft_s"] * 1000 for r in rounds["B"]],
        "long_prompt_tokens": [r["long_prompt_tokens"] for r in rounds["B"]],
        "streams_outlived_window": all(r["streams_outlived_window"] for r in rounds["B"]),
    }


def render_markdown(doc: dict) -> str:
    lines = [
        "| config | ITL p50 / p99 ms, no long prompt | ITL p50 / p99 ms, while long prompt "
        "runs (gaps) | p50 / p99 ms, whole phase B | p99 ratio (with/without) | long TTFT ms "
        "(median, max) |",
        "|---|---|---|---|---|---|",
    ]
    for c in doc["configs"]:
        a, w, o = c["itl_ms_no_long"], c["itl_ms_long_window"], c["itl_ms_long_overall"]
        ttft = sorted(c["long_ttft_ms"])
        lines.append(
            f"| {c['config']} (budget {c['max_num_batched_tokens']}) "
            f"| {a['p50']:.1f} / {a['p99']:.1f} "
            f"| {w['p50']:.1f} / {w['p99']:.1f} ({c['num_gaps_window']}) "
            f"| {o['p50']:.1f} / {o['p99']:.1f} | {c['p99_ratio']:.2f}x "
            f"| {ttft[len(ttft) // 2]:.0f}, {ttft[-1]:.0f} |"
        )
    chunked = doc["configs"][0]
    met = chunked["p99_ratio"] is not None and chunked["p99_ratio"] <= GOAL_RATIO
    lines += [
        "",
        f"Goal (chunked p99 ratio ≤ {GOAL_RATIO:.0f}x): "
        f"{'met' if met else 'not met'} ({chunked['p99_ratio']:.2f}x).",
    ]
    lines += ["", f"Run: {json.dumps(doc['run'])}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=256, help="chunked config's token budget")
    p.add_argument("--unchunked-budget", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--long-len", type=int, default=2000, help="long prompt's tokens")
    p.add_argument("--prompt-len", type=int, default=32, help="each stream's prompt tokens")
    p.add_argument("--max-tokens", type=int, default=200, help="each stream's output tokens")
    p.add_argument(
        "--lead-tokens",
        type=int,
        default=20,
        help="tokens every stream has before the long prompt is sent",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="pass --compile to the servers")
    p.add_argument("--model", type=Path, help="checkpoint dir (default: dummy tiny Qwen3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-root", type=Path, default=RESULTS_ROOT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model or make_dummy_checkpoint(MODEL_CACHE / "tiny-seed0", "tiny")
    out_dir = results_dir(args.output_root, "chunked-prefill")
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True)
    run = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "model": str(model_dir),
        "cpu": cpu.stdout.split(":")[-1].strip(),
        "load_average_start": os.getloadavg(),
    }
    maker = PromptMaker(model_dir, args.seed)
    configs = [
        run_config("chunked", args.budget, args, model_dir, maker, out_dir),
        run_config("unchunked", args.unchunked_budget, args, model_dir, maker, out_dir),
    ]
    run["load_average_end"] = os.getloadavg()
    doc = {"run": run, "args": {k: str(v) for k, v in vars(args).items()}, "configs": configs}
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2))
    markdown = render_markdown(doc)
    (out_dir / "results.md").write_text(markdown)
    print(markdown)
    if not all(c["streams_outlived_window"] for c in configs):
        log("warning: some streams ended before the long prompt finished; raise --max-tokens")
    log(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
