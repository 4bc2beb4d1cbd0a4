"""Running the arms: each workload's phases against one server, the arms in turn or in rounds."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from nanoserve.bench import background, workloads
from nanoserve.bench.arms import ArmOptions, ArmSpec, Server
from nanoserve.bench.client import (
    PhaseResults,
    RequestResult,
    completion_body,
    run_phase,
    run_typing,
)
from nanoserve.bench.workloads import Phase, Workload

WorkloadResults = dict[str, dict[str, PhaseResults]]  # workload -> arm -> its phases


@contextlib.contextmanager
def signals_end_the_run() -> Iterator[None]:
    """While servers run, SIGTERM and SIGHUP end the run as Ctrl-C does, so that every `finally`
    stops its servers (by default Python dies at once and leaves them running: each is in a
    session of its own)."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
    for signum in previous:
        signal.signal(signum, _end_as_ctrl_c)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _end_as_ctrl_c(signum: int, frame: FrameType | None) -> None:
    """Do what Ctrl-C does now: call SIGINT's handler, Python's (a KeyboardInterrupt) or, while
    requests are measured, `asyncio.run`'s (the measuring task is cancelled and unwinds, then
    `asyncio.run` raises the KeyboardInterrupt). A KeyboardInterrupt raised in the middle of the
    event loop's work could be lost in a callback (an import's lock) or wrapped in a task group's
    error instead."""
    on_ctrl_c = signal.getsignal(signal.SIGINT)
    if not callable(on_ctrl_c):
        raise KeyboardInterrupt
    on_ctrl_c(signal.SIGINT, frame)


def run_workload(server: Server, workload: Workload, args: argparse.Namespace) -> PhaseResults:
    """The workload's warm-up requests (not counted), then each of its phases in order, with
    the background load (`--background-load`) running throughout."""
    with background.running(args.background_load):
        return _run_workload(server, workload, args)


def _run_workload(server: Server, workload: Workload, args: argparse.Namespace) -> PhaseResults:
    url = server.base_url + "/v1/completions"
    name = server.spec.name
    warmup = [
        completion_body(
            server.served_model,
            prompt,
            min(16, workload.phases[0].max_tokens),
            temperature=args.temperature,
        )
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
    bodies = [
        completion_body(model, p, phase.max_tokens, phase.ignore_eos, args.temperature)
        for p in phase.prompts
    ]
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


def _arm_description(
    spec: ArmSpec, server: Server, status: str, args: argparse.Namespace
) -> dict[str, object]:
    dtype = "bfloat16" if not args.model else "the checkpoint's"
    return {"name": spec.name, "dtype": dtype, **server.description, "status": status}


def _failure(name: str, exc: Exception) -> str:
    """Report an arm's failure; its status for the table."""
    print(f"[{name}] {exc}", file=sys.stderr, flush=True)
    return f"failed: {exc}".splitlines()[0][:200]


def _start(server: Server) -> None:
    name = server.spec.name
    what = "waiting for" if server.spec.kind == "url" else "starting; waiting for"
    print(
        f"[{name}] {what} it to answer, at most {server.ready_timeout_s:.0f} s...",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    server.start()
    print(
        f"[{name}] ready at {server.base_url} after {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def run_arms_in_turn(
    arms: list[ArmSpec],
    built: list[Workload],
    model_dir: Path,
    options: ArmOptions,
    args: argparse.Namespace,
) -> tuple[WorkloadResults, list[dict], bool]:
    """Start one server, run every workload against it, stop it; then the next arm.

    Returns {workload: {arm: phases}}, the arm descriptions, and whether an arm failed.
    """
    results: WorkloadResults = {w.name: {} for w in built}
    descriptions, failed = [], False
    with signals_end_the_run():
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


def run_arms_in_rounds(
    arms: list[ArmSpec],
    built: list[Workload],
    model_dir: Path,
    options: ArmOptions,
    args: argparse.Namespace,
) -> tuple[list[tuple[list[Workload], WorkloadResults]], list[dict], bool]:
    """Start every server, then run each round's workloads against every arm in turn.

    The arm order rotates from round to round, so slow drifts of the machine (other tenants,
    clock, memory bandwidth) fall on every arm alike; the servers idle while not measured.
    Returns [(round's workloads, {workload: {arm: phases}})], the arm descriptions, and
    whether an arm failed.
    """
    servers = {spec.name: Server(spec, model_dir, options) for spec in arms}
    statuses, failed = {}, False
    with signals_end_the_run():
        try:
            for name, server in servers.items():
                try:
                    _start(server)
                    statuses[name] = "ok"
                except Exception as exc:
                    statuses[name], failed = _failure(name, exc), True
            names = [name for name in servers if statuses[name] == "ok"]
            rounds = [_run_round(i, names, servers, built, args) for i in range(args.rounds)]
        finally:
            for server in servers.values():
                server.stop()
    descriptions = [
        _arm_description(spec, servers[spec.name], statuses[spec.name], args) for spec in arms
    ]
    return rounds, descriptions, failed


def _run_round(
    index: int,
    names: list[str],
    servers: dict[str, Server],
    built: list[Workload],
    args: argparse.Namespace,
) -> tuple[list[Workload], WorkloadResults]:
    """Round `index`: its salted workloads against every started arm, the order rotated."""
    round_workloads = [workloads.for_round(w, index) for w in built]
    measured: dict[tuple[str, str], PhaseResults] = {}  # (workload, arm) -> its phases
    shift = index % max(1, len(names))
    for name in names[shift:] + names[:shift]:
        print(f"round {index + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
        for workload in round_workloads:
            measured[workload.name, name] = run_workload(servers[name], workload, args)
    # Keyed in the arms' order (the table's rows), whoever ran first.
    round_results = {w.name: {name: measured[w.name, name] for name in names} for w in built}
    return round_workloads, round_results


def pool_rounds(rounds: list[dict[str, PhaseResults]]) -> dict[str, PhaseResults]:
    """{arm: {phase: (results, seconds)}} of each round -> one, requests and time summed."""
    pooled: dict[str, PhaseResults] = {}
    for round_results in rounds:
        for arm, phases in round_results.items():
            for label, (results, duration_s) in phases.items():
                so_far, seconds = pooled.setdefault(arm, {}).get(label, ([], 0.0))
                pooled[arm][label] = (so_far + results, seconds + duration_s)
    return pooled
