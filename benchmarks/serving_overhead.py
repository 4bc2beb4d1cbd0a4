"""Serving overhead: the same workload offline (`LLM.generate`) and through the HTTP server.

    python -m benchmarks.serving_overhead [--preset tiny] [--num-prompts 16] [--input-len 128]
        [--output-len 64] [--threads 2] [--compile]

Both arms load the same dummy-weight bf16 checkpoint (nanoserve.bench.models) with the same
engine configuration (dtype, device, max_model_len, max_num_seqs, eager or not; recorded in the
JSON) and get the same text prompts, greedy, ignore_eos, exactly --output-len tokens each:

    throughput   all --num-prompts requests at once: output tokens / wall time. Offline: one
                 `LLM.generate` call. Server: that many concurrent streams
                 (nanoserve.bench.client), first send to last [DONE]. Median over --repeats
                 runs, each on fresh prompts (so the prefix cache never helps).
    TTFT         one request at a time, median over --ttft-requests. Offline: `add_request`
                 until the engine step that yields its first token. Server: request sent until
                 the first SSE chunk with choices (concurrency 1).

Goal (issue 3): server throughput ≥ 90% of offline at 16 streams, and ≤ 10 ms added to TTFT.
Both arms are loaded side by side and warmed up with batches of 1 and --num-prompts before
measuring (the decode path may compile per batch shape). Measurements then alternate between the
arms, run by run and request by request, so that load from other processes on a shared machine
falls on both alike; only one arm is ever busy. Results print as a table and go to
benchmarks/results/<date>-serving-overhead/ as results.json and results.md (with the server log).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nanoserve.bench.arms import ArmOptions, ArmSpec, Server
from nanoserve.bench.client import (
    RequestResult,
    completion_body,
    make_client,
    run_phase,
    stream_completion,
)
from nanoserve.bench.metrics import summarize
from nanoserve.bench.models import PRESETS, make_dummy_checkpoint
from nanoserve.bench.results import results_dir
from nanoserve.bench.workloads import PromptMaker

DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "nanoserve" / "bench-models"
DEFAULT_OUTPUT_ROOT = Path(__file__).resolve().parent / "results"  # benchmarks/results
GOAL_THROUGHPUT_RATIO = 0.90
GOAL_TTFT_ADDED_MS = 10.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"load average: {', '.join(f'{x:.2f}' for x in load_average())}"


def engine_config(args: argparse.Namespace) -> dict[str, object]:
    """The one engine configuration both arms use (EngineConfig fields)."""
    return {
        "dtype": "bfloat16",
        "device": "cpu",
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory": args.kv_cache_memory,
        "compile_decode": args.compile,
    }


def server_flags(config: dict[str, object]) -> list[str]:
    """`nanoserve serve` flags that give the server the same engine configuration."""
    flags = ["--dtype", str(config["dtype"]), "--device", str(config["device"])]
    flags += ["--max-model-len", str(config["max_model_len"])]
    flags += ["--max-num-seqs", str(config["max_num_seqs"])]
    flags += ["--kv-cache-memory", str(config["kv_cache_memory"])]
    return flags + (["--compile"] if config["compile_decode"] else [])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return children


# -- the two arms ------------------------------------------------------------------------------


class OfflineArm:
    """`LLM` in this process: throughput with `generate`, TTFT with the engine directly."""

    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        import torch

        from nanoserve import LLM, SamplingParams

        torch.set_num_threads(args.threads)
        self.llm = LLM(str(model_dir), **engine_config(args))
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.warmup_params = SamplingParams(
            temperature=0.0, max_tokens=args.warmup_tokens, ignore_eos=True
        )

    def warm_up(self, prompts: list[str]) -> None:
        self.llm.generate(prompts[:1], self.warmup_params)
        self.llm.generate(prompts, self.warmup_params)

    def throughput(self, prompts: list[str]) -> tuple[dict, list[str]]:
        """All prompts in one `generate` call: (output tokens and wall time, texts)."""
        cpu_start, start = time.process_time(), time.perf_counter()
        outputs = self.llm.generate(prompts, self.params)
        duration_s = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        run = {
            "output_tokens": tokens,
            "duration_s": duration_s,
            "tok_s": tokens / duration_s,
            "cpu_s": {"engine": time.process_time() - cpu_start},
        }
        return run, [o.outputs[0].text for o in outputs]

    def first_token_s(self, prompt: str) -> float:
        """Seconds from `add_request` to the engine step that yields the request's first token."""
        engine = self.llm.engine
        token_ids = self.llm.tokenizer.encode(prompt, add_special_tokens=True)
        start = time.perf_counter()
        engine.add_request("ttft", token_ids, self.params)
        try:
            while True:
                deltas = engine.step()
                if any(d.request_id == "ttft" and d.new_token_ids for d in deltas):
                    return time.perf_counter() - start
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the request finished without a token")
        finally:
            engine.abort(["ttft"])


class ServerArm:
    """`nanoserve serve` as a subprocess with the same engine flags, driven by streamed requests."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, log_dir: Path) -> None:
        self.args = args
        self.flags = server_flags(engine_config(args))
        options = ArmOptions(
            threads=args.threads,
            max_model_len=args.max_model_len,
            startup_timeout_s=args.startup_timeout_s,
            log_dir=log_dir,
            nanoserve_args=self.flags,
        )
        self.server = Server(ArmSpec(name="nanoserve", kind="nanoserve"), model_dir, options)

    @property
    def url(self) -> str:
        return self.server.base_url + "/v1/completions"

    def body(self, prompt: str, max_tokens: int) -> dict:
        return completion_body(self.server.served_model, prompt, max_tokens, ignore_eos=True)

    def phase(self, prompts: list[str], max_tokens: int, label: str) -> tuple[list, float]:
        """All prompts at once as concurrent streams; raises on any failed request."""
        bodies = [self.body(p, max_tokens) for p in prompts]
        timeout_s = self.args.request_timeout_s
        results, duration_s = asyncio.run(
            run_phase(self.url, bodies, None, math.inf, 0, timeout_s, f"server {label}")
        )
        errors = sorted({r.error for r in results if r.error})
        if errors:
            raise RuntimeError(f"server {label}: {len(errors)} kinds of error: {errors[:3]}")
        return results, duration_s

    def warm_up(self, prompts: list[str]) -> None:
        self.phase(prompts[:1], self.args.warmup_tokens, "warm-up x1")
        self.phase(prompts, self.args.warmup_tokens, f"warm-up x{len(prompts)}")

    def throughput(self, prompts: list[str]) -> tuple[dict, list[str]]:
        """All prompts as concurrent streams, first send to last [DONE]: (run, texts)."""
        before = self.cpu_s()
        results, duration_s = self.phase(prompts, self.args.output_len, "throughput")
        after = self.cpu_s()
        summary = summarize(results, duration_s)
        tokens = summary["output_tokens"]
        run = {
            "output_tokens": tokens,
            "duration_s": duration_s,
            "tok_s": tokens / duration_s,
            "ttft_ms": summary["ttft_ms"],
            "itl_ms": summary["itl_ms"],
            "cpu_s": {name: after[name] - before[name] for name in after},
        }
        return run, [r.text for r in results]

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by the worker, the HTTP front and this client process."""
        assert self.server.process is not None
        front = self.server.process.pid
        workers = child_pids(front)
        return {
            "worker": sum(process_cpu_s(pid) for pid in workers),
            "front": process_cpu_s(front),
            "client": time.process_time(),
        }


def measure_throughput(offline: OfflineArm, server: ServerArm, batches: list[list[str]]) -> dict:
    """Alternate the arms run by run (and which goes first), so load drift hits both alike."""
    runs: dict[str, list[dict]] = {"offline": [], "server": []}
    texts: dict[str, list[str]] = {}
    for i, batch in enumerate(batches):
        order = [("offline", offline), ("server", server)]
        for name, arm in order if i % 2 == 0 else order[::-1]:
            run, run_texts = arm.throughput(batch)
            runs[name].append(run)
            texts.setdefault(name, run_texts)
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in run["cpu_s"].items())
            log(
                f"{name}: throughput run {i + 1}/{len(batches)}: {run['output_tokens']} tokens "
                f"in {run['duration_s']:.2f} s = {run['tok_s']:.1f} tok/s; CPU s: {cpu}"
            )
            time.sleep(0.5)  # let the other arm's threads stop spinning
    return {"runs": runs, "texts": texts}


async def measure_ttft(offline: OfflineArm, server: ServerArm, prompts: list[str]) -> dict:
    """One request at a time, alternating the arms; the server's over one kept-alive client."""
    ttft_s: dict[str, list[float]] = {"offline": [], "server": []}
    async with make_client(server.args.request_timeout_s) as client:
        for i, prompt in enumerate(prompts):
            ttft_s["offline"].append(offline.first_token_s(prompt))
            await asyncio.sleep(0.2)
            result = RequestResult(index=i)
            body = server.body(prompt, server.args.output_len)
            await stream_completion(client, server.url, body, result, time.perf_counter())
            if result.error or result.ttft_s is None:
                raise RuntimeError(f"server TTFT request {i} failed: {result.error}")
            ttft_s["server"].append(result.ttft_s)
            await asyncio.sleep(0.2)
    for name, values in ttft_s.items():
        log(f"{name}: TTFT median {statistics.median(values) * 1e3:.1f} ms over {len(values)}")
    return ttft_s


# -- report ------------------------------------------------------------------------------------


def summarize_arm(runs: list[dict], ttft_s: list[float]) -> dict:
    ttft_ms = [t * 1e3 for t in ttft_s]
    return {
        "tok_s_median": statistics.median(r["tok_s"] for r in runs),
        "tok_s_runs": [r["tok_s"] for r in runs],
        "ttft_ms_median": statistics.median(ttft_ms),
        "ttft_ms_min": min(ttft_ms),
        "ttft_ms_max": max(ttft_ms),
        "cpu_s_median": {
            name: statistics.median(r["cpu_s"][name] for r in runs) for name in runs[0]["cpu_s"]
        },
    }


def render_markdown(document: dict) -> str:
    offline, server = (document["arms"][name]["summary"] for name in ("offline", "server"))
    verdict = document["verdict"]
    p = document["params"]

    def row(name: str, s: dict) -> str:
        runs = ", ".join(f"{x:.0f}" for x in s["tok_s_runs"])
        return (
            f"| {name} | {s['tok_s_median']:.1f} ({runs}) | {s['ttft_ms_median']:.1f} "
            f"({s['ttft_ms_min']:.1f}–{s['ttft_ms_max']:.1f}) |"
        )

    def cpu(s: dict) -> str:
        return ", ".join(f"{name} {value:.2f}" for name, value in s["cpu_s_median"].items())

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    machine = document["machine"]
    lines = [
        f"# Serving overhead — {document['date']}",
        "",
        f"Model: {document['model']['description']}. Engine config (both arms): "
        f"`{json.dumps(document['engine_config'])}`; {p['threads']} compute threads.",
        f"Workload: {p['num_prompts']} prompts × {p['input_len']} tokens, {p['output_len']} "
        f"output tokens each (greedy, ignore_eos), {p['repeats']} throughput runs on fresh "
        f"prompts; TTFT over {p['ttft_requests']} single requests.",
        f"Load: `{machine['uptime_at_start']}` at the start, load average "
        f"{machine['load_average_at_end']} at the end ({machine['cpu_count']} CPUs; other work "
        "skews every number).",
        f"Command: `{document['command']}`",
        "",
        f"| arm | output tok/s at {p['num_prompts']} streams, median (runs) "
        "| TTFT ms at c=1, median (min–max) |",
        "|---|---|---|",
        row("offline `LLM.generate`", offline),
        row("HTTP server, streaming", server),
        "",
        f"- throughput: server / offline = **{verdict['throughput_ratio']:.1%}** (goal ≥ "
        f"{GOAL_THROUGHPUT_RATIO:.0%}: {met(verdict['throughput_goal_met'])}); run by run: "
        + ", ".join(f"{r:.0%}" for r in verdict["throughput_ratio_runs"]),
        f"- TTFT added by the server: **{verdict['ttft_added_ms']:+.1f} ms** (goal ≤ "
        f"{GOAL_TTFT_ADDED_MS:.0f} ms: {met(verdict['ttft_goal_met'])})",
        f"- greedy outputs identical in both arms: {verdict['same_text']}/{p['num_prompts']}",
        "- CPU seconds per throughput run (median; a spinning compute thread counts as busy): "
        f"offline {cpu(offline)}; server {cpu(server)}",
    ]
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------


def make_prompts(model_dir: Path, args: argparse.Namespace) -> dict:
    """Distinct random prompts for warm-up, each throughput run and the TTFT requests."""
    maker = PromptMaker(model_dir, args.seed)

    def texts(n: int) -> list[str]:
        return [maker.random_text(args.input_len) for _ in range(n)]

    return {
        "warmup": texts(args.num_prompts),
        "throughput": [texts(args.num_prompts) for _ in range(args.repeats)],
        "ttft": texts(args.ttft_requests),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--num-prompts", type=int, default=16, help="concurrent requests")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs per arm (median)")
    p.add_argument("--ttft-requests", type=int, default=10, help="single requests for TTFT")
    p.add_argument("--warmup-tokens", type=int, default=8, help="output tokens of warm-ups")
    p.add_argument("--threads", type=int, default=2, help="compute threads of each arm")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes, each arm")
    p.add_argument("--compile", action="store_true", help="both arms with the compiled decode step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-cache", type=Path, default=DEFAULT_MODEL_CACHE)
    p.add_argument("--output-root", type=Path, default=DEFAULT_OUTPUT_ROOT)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "repeats", "ttft_requests", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.input_len + args.output_len > args.max_model_len:
        p.error(f"--input-len + --output-len must be ≤ --max-model-len ({args.max_model_len})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "uptime_at_start": uptime(),
        "load_average_at_start": load_average(),
    }
    log(machine["uptime_at_start"])
    model_dir = make_dummy_checkpoint(
        args.model_cache / f"{args.preset}-seed{args.seed}", args.preset, args.seed
    )
    prompts = make_prompts(model_dir, args)
    out_dir = results_dir(args.output_root, "serving-overhead")

    log("offline: loading the engine")
    started = time.perf_counter()
    offline = OfflineArm(model_dir, args)
    log(
        f"offline: ready after {time.perf_counter() - started:.1f} s; warming up (batch 1 and "
        f"{args.num_prompts})"
    )
    offline.warm_up(prompts["warmup"])
    server = ServerArm(model_dir, args, out_dir)
    log(f"server: starting (OMP_NUM_THREADS={args.threads}; {' '.join(server.flags)})")
    started = time.perf_counter()
    server.server.start()
    try:
        log(
            f"server: ready after {time.perf_counter() - started:.1f} s; warming up (batch 1 "
            f"and {args.num_prompts})"
        )
        server.warm_up(prompts["warmup"])
        throughput = measure_throughput(offline, server, prompts["throughput"])
        ttft_s = asyncio.run(measure_ttft(offline, server, prompts["ttft"]))
    finally:
        server.server.stop()
    machine["load_average_at_end"] = load_average()
    log(f"load average at the end: {machine['load_average_at_end']}")

    runs = throughput["runs"]
    summaries = {name: summarize_arm(runs[name], ttft_s[name]) for name in runs}
    ratio = summaries["server"]["tok_s_median"] / summaries["offline"]["tok_s_median"]
    ratio_runs = [
        s["tok_s"] / o["tok_s"] for o, s in zip(runs["offline"], runs["server"], strict=True)
    ]
    added_ms = summaries["server"]["ttft_ms_median"] - summaries["offline"]["ttft_ms_median"]
    texts = throughput["texts"]
    same = sum(a == b for a, b in zip(texts["offline"], texts["server"], strict=True))
    command = "python -m benchmarks.serving_overhead"
    document = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([command, *(argv if argv is not None else sys.argv[1:])]),
        "params": {k: v for k, v in vars(args).items() if k not in ("model_cache", "output_root")},
        "model": {
            "dir": str(model_dir),
            "description": f"dummy-weight Qwen3 `{args.preset}` shape, bf16, seed {args.seed}",
        },
        "engine_config": engine_config(args),
        "machine": machine,
        "server_command": server.server.description.get("command"),
        "server_version": server.server.description.get("version"),
        "arms": {
            name: {
                "summary": summaries[name],
                "throughput_runs": runs[name],
                "ttft_s": ttft_s[name],
                "texts": texts[name],
            }
            for name in runs
        },
        "verdict": {
            "throughput_ratio": ratio,
            "throughput_ratio_runs": ratio_runs,
            "throughput_goal_met": ratio >= GOAL_THROUGHPUT_RATIO,
            "ttft_added_ms": added_ms,
            "ttft_goal_met": added_ms <= GOAL_TTFT_ADDED_MS,
            "same_text": same,
        },
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=1, default=str))
    markdown = render_markdown(document)
    (out_dir / "results.md").write_text(markdown)
    print(markdown)
    log(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
