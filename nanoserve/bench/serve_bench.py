"""Serving benchmark: start each server, send every one the same requests, print one table.

    nanoserve bench --workload scoreboard              # nanoserve vs hf
    nanoserve bench --workload sweep --concurrency 1,4,16 --arm vllm
    nanoserve bench --workload all --arm nanoserve --arm url=sglang=http://h:30000

By default every arm loads a dummy-weight Qwen3 checkpoint (`--preset`, bf16, seeded) written
with a byte-level tokenizer to a temporary directory, so nothing is downloaded. Results go to
<output root>/<date>-<workload>/ as results.md, results.json and PNG plots; the output root is
./benchmarks/results, relative to the current directory, unless --output-root names another.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from nanoserve.bench import report, workloads
from nanoserve.bench.arms import DEFAULT_VLLM_VENV, ArmOptions, Server, parse_arm
from nanoserve.bench.client import RequestResult, completion_body, run_phase, run_typing
from nanoserve.bench.metrics import summarize
from nanoserve.bench.models import PRESETS, decode_weight_bytes, make_dummy_checkpoint
from nanoserve.bench.workloads import Phase, PromptMaker, Workload

DEFAULT_OUTPUT_ROOT = Path("benchmarks") / "results"  # relative to the current directory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="nanoserve bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--workload",
        nargs="+",
        default=["scoreboard"],
        choices=[*workloads.WORKLOADS, "all"],
        help="one or more workloads; each writes its own results directory",
    )
    p.add_argument(
        "--arm",
        action="append",
        default=None,
        help="nanoserve | hf | vllm | url=NAME=http://host:port | cmd=NAME='cmd {port} {model}' "
        "(repeat; default: nanoserve and hf)",
    )
    p.add_argument(
        "--baseline", default=None, help="arm the ratios are against (default: nanoserve)"
    )
    model = p.add_argument_group("model")
    model.add_argument("--model", default=None, help="checkpoint directory every arm loads")
    model.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    model.add_argument(
        "--model-dir",
        default=None,
        help="write (or reuse) the dummy checkpoint here, not in a tmpdir",
    )
    load = p.add_argument_group("load")
    load.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    load.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads per arm")
    load.add_argument("--num-warmup", type=int, default=2, help="uncounted requests per workload")
    load.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf")
    load.add_argument("--max-concurrency", type=int, default=1, help="shared-prefix concurrency")
    load.add_argument("--request-timeout-s", type=float, default=600.0)
    load.add_argument("--startup-timeout-s", type=float, default=900.0)
    load.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with R > 1 every server stays up and each round runs every arm in turn (the order "
        "rotating), with per-round prompt prefixes; the table pools all rounds. Needs memory "
        "for all servers at once",
    )
    board = p.add_argument_group("scoreboard")
    board.add_argument("--scoreboard-prompts", type=int, default=8)
    board.add_argument("--scoreboard-max-tokens", type=int, default=50)
    board.add_argument("--scoreboard-concurrency", type=int, default=8)
    sweep = p.add_argument_group("sweep")
    sweep.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated levels")
    sweep.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    sweep.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    sweep.add_argument(
        "--num-prompts", type=int, default=None, help="per level (default max(8, 2×concurrency))"
    )
    typing = p.add_argument_group("autocomplete")
    typing.add_argument("--autocomplete-file", type=Path, default=None, help="default: textwrap.py")
    typing.add_argument("--autocomplete-context", type=int, default=256, help="chars typed already")
    typing.add_argument("--autocomplete-chars", type=int, default=120, help="chars to type")
    typing.add_argument("--typing-cps", type=float, default=8.0, help="typing speed, chars/s")
    typing.add_argument("--debounce-ms", type=float, default=50.0)
    typing.add_argument("--autocomplete-max-tokens", type=int, default=10)
    prefix = p.add_argument_group("shared-prefix")
    prefix.add_argument("--num-groups", type=int, default=4)
    prefix.add_argument("--prompts-per-group", type=int, default=4)
    prefix.add_argument("--prefix-len", type=int, default=1000, help="shared prompt tokens")
    prefix.add_argument("--question-len", type=int, default=24, help="distinct tokens per prompt")
    prefix.add_argument("--prefix-output-len", type=int, default=16)
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
    servers.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    servers.add_argument("--vllm-args", default="", help="extra arguments for vLLM (one string)")
    out = p.add_argument_group("output")
    out.add_argument(
        "--output-root",
        type=Path,
        default=DEFAULT_OUTPUT_ROOT,
        help="results go to OUTPUT_ROOT/<date>-<workload>/; a relative path is relative to the "
        "current directory",
    )
    out.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if "all" in args.workload:
        args.workload = list(workloads.WORKLOADS)
    args.workload = list(dict.fromkeys(args.workload))
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error(f"--concurrency levels must be ≥ 1, got {args.concurrency}")
    if args.threads is None or args.threads < 1:
        p.error(f"--threads must be ≥ 1, got {args.threads}")
    if args.rounds < 1:
        p.error(f"--rounds must be ≥ 1, got {args.rounds}")
    if args.request_rate <= 0:
        p.error(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    return args


def measure_read_bandwidth_gb_s(threads: int) -> tuple[float, str]:
    """Memory read bandwidth of this machine (sum over 256 MB of bf16), median of 5."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(threads)
    numel = 1 << 30 if device == "cuda" else 1 << 27  # 2 GB on a GPU, 256 MB on CPU
    x = torch.ones(numel, dtype=torch.bfloat16, device=device)
    timings = []
    for _ in range(6):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    median_s = sorted(timings[1:])[len(timings[1:]) // 2]
    return x.numel() * x.element_size() / median_s / 1e9, device


def build_workloads(args: argparse.Namespace, maker: PromptMaker) -> list[Workload]:
    built = []
    for name in args.workload:
        if name == "scoreboard":
            w = workloads.scoreboard(
                args.scoreboard_prompts, args.scoreboard_max_tokens, args.scoreboard_concurrency
            )
        elif name == "sweep":
            w = workloads.sweep(
                maker,
                args.concurrency,
                args.input_len,
                args.output_len,
                args.num_prompts,
                args.request_rate,
            )
        elif name == "autocomplete":
            w = workloads.autocomplete(
                args.autocomplete_file or workloads.default_autocomplete_source(),
                args.autocomplete_context,
                args.autocomplete_chars,
                args.typing_cps,
                args.debounce_ms,
                args.autocomplete_max_tokens,
                args.seed,
            )
        else:
            w = workloads.shared_prefix(
                maker,
                args.num_groups,
                args.prompts_per_group,
                args.prefix_len,
                args.question_len,
                args.prefix_output_len,
                args.max_concurrency,
                args.request_rate,
            )
        # Warm-up prompts are as long as the first real one but share no prefix with it, so
        # that they warm the server without filling a prefix cache with the measured prompts.
        length = maker.num_tokens(w.phases[0].prompts[0])
        w.params["warmup_prompts"] = [maker.random_text(length) for _ in range(args.num_warmup)]
        built.append(w)
    return built


def run_workload(
    server: Server, workload: Workload, args: argparse.Namespace
) -> dict[str, tuple[list[RequestResult], float]]:
    url = server.base_url + "/v1/completions"
    name = server.spec.name
    warmup = [
        completion_body(server.served_model, prompt, min(16, workload.phases[0].max_tokens))
        for prompt in workload.params["warmup_prompts"]
    ]
    if warmup:
        # All at once: a server that compiles per batch shape meets a batch > 1 here, not in
        # the first measured phase.
        results, _ = asyncio.run(
            run_phase(url, warmup, None, math.inf, args.seed, args.request_timeout_s, "warm-up")
        )
        for result in results:
            if result.error:
                print(f"  [{name}] warm-up request failed: {result.error}", file=sys.stderr)
    phases = {}
    for phase in workload.phases:
        label = f"[{name}] {workload.name} {phase.label}"
        phases[phase.label] = _run_phase(url, server.served_model, phase, args, label)
    return phases


def _run_phase(
    url: str, model: str, phase: Phase, args: argparse.Namespace, label: str
) -> tuple[list[RequestResult], float]:
    bodies = [completion_body(model, p, phase.max_tokens, phase.ignore_eos) for p in phase.prompts]
    if phase.send_times_s is not None:
        timed = list(zip(bodies, phase.send_times_s, strict=True))
        return asyncio.run(run_typing(url, timed, args.request_timeout_s, label))
    return asyncio.run(
        run_phase(
            url,
            bodies,
            phase.max_concurrency,
            phase.request_rate,
            args.seed,
            args.request_timeout_s,
            label,
        )
    )


def results_dir(root: Path, workload: str) -> Path:
    """<root>/<date>-<workload>, with -2, -3 ... when a run of the same day is already there."""
    base = f"{datetime.date.today().isoformat()}-{workload}"
    candidate, n = root / base, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{base}-{n}"
    candidate.mkdir(parents=True)
    return candidate


def write_outputs(
    workload: Workload,
    arm_results: dict[str, dict],
    arm_descriptions: list[dict],
    baseline: str,
    run_info: dict,
    args: argparse.Namespace,
    log_dir: Path,
    per_round: list[tuple[Workload, dict]] | None = None,
) -> tuple[Path, str]:
    """results.json, results.md and plots; with rounds, the pooled table and one per round."""
    out_dir = results_dir(args.output_root, workload.name)
    bound = run_info.get("bound_tok_s")
    rows = report.build_rows(workload, arm_results, baseline, bound)
    round_rows = [report.build_rows(w, r, baseline, bound) for w, r in per_round or []]
    columns = report.columns_for(workload)
    plots: list[str] = []
    plot_error = None
    if not args.no_plots and arm_results:
        try:
            plots = report.plot(workload, arm_results, rows, out_dir)
        except ImportError as exc:
            plot_error = f"no plots: {exc} (pip install matplotlib)"
            print(plot_error, file=sys.stderr)
    params = {k: v for k, v in workload.params.items() if k != "warmup_prompts"}
    document = {
        "workload": workload.name,
        "params": params,
        "baseline": baseline,
        **run_info,
        "arms": arm_descriptions,
        "table": {
            "columns": [{"key": c.key, "header": c.header, "ratio": c.ratio} for c in columns],
            "rows": rows,
        },
        "phases": {
            arm: {
                label: {
                    "summary": summarize(results, duration_s),
                    "requests": [r.to_json() for r in results],
                }
                for label, (results, duration_s) in phases.items()
            }
            for arm, phases in arm_results.items()
        },
        "plots": plots,
        "plot_error": plot_error,
        "rounds": [{"rows": r} for r in round_rows],
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=1))
    for log in log_dir.glob("*.log"):
        shutil.copy(log, out_dir / log.name)
    markdown = render_markdown(
        workload, columns, rows, arm_descriptions, baseline, run_info, plots, round_rows
    )
    (out_dir / "results.md").write_text(markdown)
    return out_dir, markdown


def render_markdown(
    workload, columns, rows, arm_descriptions, baseline, run_info, plots, round_rows=()
) -> str:
    params = ", ".join(
        f"{k}={v}" for k, v in workload.params.items() if k not in ("warmup_prompts", "source")
    )
    model, machine = run_info["model"], run_info["machine"]
    model_line = f"Model: {model['description']}"
    if model.get("decode_weight_bytes"):
        model_line += f"; one decode step reads {model['decode_weight_bytes'] / 1e6:,.1f} MB"
    machine_line = (
        f"Machine: {machine['cpu_count']} CPUs, {machine['platform']}; read bandwidth "
        f"{machine['read_bandwidth_gb_s']:.1f} GB/s ({machine['bandwidth_device']}, measured "
        "in this run)"
    )
    if run_info.get("bound_tok_s"):
        machine_line += f", so one stream's decode bound is {run_info['bound_tok_s']:,.1f} tok/s"
    machine_line += (
        f"; 1-minute load average {machine['load_average_at_start']:.1f} at the start, "
        f"{machine['load_average_at_end']:.1f} at the end (other work skews the numbers)"
    )
    lines = [
        f"# {workload.name} — {run_info['date']}",
        "",
        model_line + ".",
        machine_line + ".",
        f"Workload: {params}; seed {run_info['seed']}; "
        f"{run_info['num_warmup']} warm-up requests per arm and workload, not counted.",
        f"Command: `{run_info['command']}`",
        "",
        "## Arms",
        "",
        report.markdown_table(report.ARM_COLUMNS, arm_descriptions),
        "",
        f"## Results (ratios: arm ÷ {baseline})",
        "",
        report.markdown_table(columns, rows, baseline),
        "",
        "TTFT: to the first chunk with non-empty `choices`. ITL: between chunks that carry text. "
        "TPOT: (e2e − TTFT) / (output tokens − 1). Output tokens from `usage`. All requests "
        "greedy (temperature 0); 'greedy outputs' counts prompts both arms finished with "
        "identical text (bf16 numerics and batching may legitimately differ).",
    ]
    if round_rows:
        lines[lines.index(f"## Results (ratios: arm ÷ {baseline})")] = (
            f"## Results, {len(round_rows)} rounds pooled (ratios: arm ÷ {baseline})"
        )
        lines += [
            "",
            "## Each round",
            "",
            "Every server stayed up; each round ran the arms in turn, the order rotating, with "
            "the prompts behind a per-round prefix (no prefix-cache hits across rounds).",
        ]
        for index, rows_of_round in enumerate(round_rows):
            lines += [
                "",
                f"Round {index + 1}:",
                "",
                report.markdown_table(columns, rows_of_round, baseline),
            ]
    if plots:
        lines += ["", *[f"![{name}]({name})" for name in plots]]
    return "\n".join(lines) + "\n"


def _arm_description(spec, server: Server, status: str, args: argparse.Namespace) -> dict:
    dtype = "bfloat16" if not args.model else "the checkpoint's"
    return {"name": spec.name, "dtype": dtype, **server.description, "status": status}


def _failure(name: str, exc: Exception) -> str:
    """Report an arm's failure; its status for the table."""
    print(f"[{name}] {exc}", file=sys.stderr, flush=True)
    return f"failed: {exc}".splitlines()[0][:200]


def _start(server: Server) -> None:
    name = server.spec.name
    print(f"[{name}] starting...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    server.start()
    print(
        f"[{name}] ready at {server.base_url} after {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def run_arms_in_turn(arms, built, model_dir, options, args):
    """Start one server, run every workload against it, stop it; then the next arm."""
    results: dict[str, dict[str, dict]] = {w.name: {} for w in built}
    descriptions, failed = [], False
    for spec in arms:
        server = Server(spec, model_dir, options)
        try:
            _start(server)
            for workload in built:
                results[workload.name][spec.name] = run_workload(server, workload, args)
            status = "ok"
        except Exception as exc:  # one arm failing must not hide the others' results
            status, failed = _failure(spec.name, exc), True
        finally:
            server.stop()
        descriptions.append(_arm_description(spec, server, status, args))
    return results, descriptions, failed


def run_arms_in_rounds(arms, built, model_dir, options, args):
    """Start every server, then run each round's workloads against every arm in turn.

    The arm order rotates from round to round, so slow drifts of the machine (other tenants,
    clock, memory bandwidth) fall on every arm alike; the servers idle while not measured.
    Returns [(round's workloads, {workload: {arm: phases}})], the arm descriptions, and
    whether an arm failed.
    """
    servers = {spec.name: Server(spec, model_dir, options) for spec in arms}
    statuses, failed = {}, False
    try:
        for name, server in servers.items():
            try:
                _start(server)
                statuses[name] = "ok"
            except Exception as exc:
                statuses[name], failed = _failure(name, exc), True
        names = [name for name in servers if statuses[name] == "ok"]
        rounds = []
        for index in range(args.rounds):
            round_workloads = [workloads.for_round(w, index) for w in built]
            # Keyed in the arms' order (the table's rows), whoever runs first.
            round_results = {w.name: dict.fromkeys(names) for w in built}
            shift = index % max(1, len(names))
            for name in names[shift:] + names[:shift]:
                print(f"round {index + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                for workload in round_workloads:
                    phases = run_workload(servers[name], workload, args)
                    round_results[workload.name][name] = phases
            rounds.append((round_workloads, round_results))
    finally:
        for server in servers.values():
            server.stop()
    descriptions = [
        _arm_description(spec, servers[spec.name], statuses[spec.name], args) for spec in arms
    ]
    return rounds, descriptions, failed


def pool_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """{arm: {phase: (results, seconds)}} of each round -> one, requests and time summed."""
    pooled: dict[str, dict] = {}
    for round_results in rounds:
        for arm, phases in round_results.items():
            for label, (results, duration_s) in phases.items():
                so_far, seconds = pooled.setdefault(arm, {}).get(label, ([], 0.0))
                pooled[arm][label] = (so_far + results, seconds + duration_s)
    return pooled


def _warn_if_busy(load_average: float) -> None:
    """Other work on the machine skews every number; say so before the run starts."""
    if load_average > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: the 1-minute load average is {load_average:.1f} on {os.cpu_count()} CPUs "
            "before any server starts; other processes will skew these measurements",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        arms = [parse_arm(text) for text in (args.arm or ["nanoserve", "hf"])]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        print(f"error: arm names must differ, got {names}", file=sys.stderr)
        return 2
    baseline = args.baseline or ("nanoserve" if "nanoserve" in names else names[0])
    if baseline not in names:
        print(f"error: --baseline {baseline!r} is not one of the arms {names}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-") as tmp:
        if args.model:
            model_dir = Path(args.model)
            model_description = str(model_dir)
        else:
            model_dir = make_dummy_checkpoint(
                args.model_dir or Path(tmp) / "model", args.preset, args.seed
            )
            model_description = f"dummy-weight Qwen3 {args.preset} shape, bf16, seed {args.seed}"
        bandwidth, bandwidth_device = measure_read_bandwidth_gb_s(args.threads)
        weight_bytes = (
            decode_weight_bytes(model_dir) if list(model_dir.glob("*.safetensors")) else 0
        )
        run_info = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(["nanoserve bench", *(argv if argv is not None else sys.argv[1:])]),
            "seed": args.seed,
            "num_warmup": args.num_warmup,
            "model": {
                "dir": str(model_dir),
                "description": model_description,
                "preset": None if args.model else args.preset,
                "decode_weight_bytes": weight_bytes or None,
            },
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "read_bandwidth_gb_s": bandwidth,
                "bandwidth_device": bandwidth_device,
                "load_average_at_start": os.getloadavg()[0],
            },
            "bound_tok_s": bandwidth * 1e9 / weight_bytes if weight_bytes else None,
        }
        built = build_workloads(args, PromptMaker(model_dir, args.seed))
        log_dir = Path(tmp) / "logs"
        options = ArmOptions(
            threads=args.threads,
            max_model_len=args.max_model_len,
            startup_timeout_s=args.startup_timeout_s,
            log_dir=log_dir,
            nanoserve_args=args.nanoserve_args.split(),
            vllm_venv=args.vllm_venv,
            vllm_args=args.vllm_args.split(),
            omp_wait_policy=args.omp_wait_policy,
        )
        _warn_if_busy(run_info["machine"]["load_average_at_start"])
        if args.rounds == 1:
            results, descriptions, failed = run_arms_in_turn(arms, built, model_dir, options, args)
            rounds = None
        else:
            rounds, descriptions, failed = run_arms_in_rounds(arms, built, model_dir, options, args)
            results = {w.name: pool_rounds([r[w.name] for _, r in rounds]) for w in built}
            built = [workloads.pooled([rw[i] for rw, _ in rounds]) for i in range(len(built))]
        run_info["machine"]["load_average_at_end"] = os.getloadavg()[0]
        for index, workload in enumerate(built):
            per_round = None
            if rounds is not None:
                per_round = [(rw[index], r[workload.name]) for rw, r in rounds]
            out_dir, markdown = write_outputs(
                workload,
                results[workload.name],
                descriptions,
                baseline,
                run_info,
                args,
                log_dir,
                per_round,
            )
            print(markdown)
            print(f"wrote {out_dir}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
