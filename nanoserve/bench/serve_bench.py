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
import datetime
import gc
import logging
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

from nanoserve.bench import workloads
from nanoserve.bench.arguments import parse_args
from nanoserve.bench.arms import ArmOptions, ArmSpec, parse_arm
from nanoserve.bench.machine import describe_machine, warn_if_busy
from nanoserve.bench.models import decode_weight_bytes, make_dummy_checkpoint
from nanoserve.bench.results import results_dir, write_outputs
from nanoserve.bench.runner import pool_rounds, run_arms_in_rounds, run_arms_in_turn
from nanoserve.bench.workloads import PromptMaker, Workload


def main(argv: list[str] | None = None) -> int:
    """`nanoserve bench`: 0 when every arm ran, 1 when one failed, 2 on a usage error, 130 when
    interrupted (Ctrl-C, or SIGTERM while servers run): one line, once every server it started
    is stopped and its temporary files are gone."""
    args = parse_args(argv)
    try:
        arms, baseline = _arms_and_baseline(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, argv, arms, baseline)
    except KeyboardInterrupt as interrupt:
        _release_interrupted_frames(interrupt)
    print("interrupted", file=sys.stderr)
    return 130


def _release_interrupted_frames(interrupt: KeyboardInterrupt) -> None:
    """Free what the interrupt's frames held, quietly. An interrupt can land between a
    coroutine's creation and its first step (`asyncio.run` not yet started), or inside a
    request's task, or inside an event loop's constructor; collected, such a coroutine warns
    "never awaited", such a task logs "Task exception was never retrieved" with the interrupt's
    traceback, and such a half-built loop's `__del__` fails on what it never set ("Exception
    ignored in ..."), around the one line `main` promises."""
    asyncio_log = logging.getLogger("asyncio")
    was_disabled, asyncio_log.disabled = asyncio_log.disabled, True
    unraisable_hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
            traceback.clear_frames(interrupt.__traceback__)
            interrupt.__traceback__ = None
            gc.collect()
    finally:
        asyncio_log.disabled = was_disabled
        sys.unraisablehook = unraisable_hook


def _run(
    args: argparse.Namespace, argv: list[str] | None, arms: list[ArmSpec], baseline: str
) -> int:
    """Every arm through every workload, then the results written and printed."""
    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-") as tmp:
        model_dir, run_info = _prepare_model(args, Path(tmp))
        run_info = _run_info(args, argv, model_dir, run_info)
        built = build_workloads(args, PromptMaker(model_dir, args.seed))
        # The servers' logs stay where failure messages say they are, beside the results.
        log_dir = results_dir(args.output_root, "logs").resolve()
        options = _arm_options(args, log_dir)
        warn_if_busy(run_info["machine"]["load_average_at_start"])
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


def _arms_and_baseline(args: argparse.Namespace) -> tuple[list[ArmSpec], str]:
    """The --arm specs (default: nanoserve and hf) and the arm the ratios are against."""
    arms = [parse_arm(text) for text in (args.arm or ["nanoserve", "hf"])]
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must differ, got {names}")
    baseline = args.baseline or ("nanoserve" if "nanoserve" in names else names[0])
    if baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not one of the arms {names}")
    return arms, baseline


def _arm_options(args: argparse.Namespace, log_dir: Path) -> ArmOptions:
    """Settings every arm gets alike."""
    return ArmOptions(
        threads=args.threads,
        max_model_len=args.max_model_len,
        startup_timeout_s=args.startup_timeout_s,
        url_timeout_s=args.url_timeout_s,
        log_dir=log_dir,
        nanoserve_args=args.nanoserve_args.split(),
        vllm_venv=args.vllm_venv,
        vllm_args=args.vllm_args.split(),
        llamacpp_dir=args.llamacpp_dir,
        llamacpp_server=args.llamacpp_server,
        llamacpp_slots=args.llamacpp_slots,
        llamacpp_args=args.llamacpp_args.split(),
        omp_wait_policy=args.omp_wait_policy,
    )


def _prepare_model(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict]:
    """The checkpoint every arm loads (--model, or a dummy one written now) and its description."""
    if args.model:
        model_dir = Path(args.model)
        description = str(model_dir)
    else:
        model_dir = make_dummy_checkpoint(args.model_dir or tmp / "model", args.preset, args.seed)
        description = f"dummy-weight Qwen3 {args.preset} shape, bf16, seed {args.seed}"
    return model_dir, {"dir": str(model_dir), "description": description}


def _run_info(
    args: argparse.Namespace, argv: list[str] | None, model_dir: Path, model: dict
) -> dict:
    """What results.json and results.md record about the run: command, model, machine, bound."""
    machine = describe_machine(args.threads)
    weight_bytes = decode_weight_bytes(model_dir) if list(model_dir.glob("*.safetensors")) else 0
    bandwidth = machine["read_bandwidth_gb_s"]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["nanoserve bench", *(argv if argv is not None else sys.argv[1:])]),
        "seed": args.seed,
        "temperature": args.temperature,
        "num_warmup": args.num_warmup,
        "model": {
            **model,
            "preset": None if args.model else args.preset,
            "decode_weight_bytes": weight_bytes or None,
        },
        "machine": machine,
        "background_load": args.background_load.describe(),
        "bound_tok_s": bandwidth * 1e9 / weight_bytes if weight_bytes else None,
    }


def build_workloads(args: argparse.Namespace, maker: PromptMaker) -> list[Workload]:
    """Each --workload's phases of prompts, with warm-up prompts of the first one's length."""
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
                args.random_range_ratio,
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


if __name__ == "__main__":
    sys.exit(main())
