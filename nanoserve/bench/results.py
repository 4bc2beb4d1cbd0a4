"""A workload's results directory: results.json, results.md, plots and the servers' logs."""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from nanoserve.bench import plots, report
from nanoserve.bench.client import PhaseResults
from nanoserve.bench.metrics import summarize
from nanoserve.bench.report import Column
from nanoserve.bench.workloads import Workload


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
    arm_results: dict[str, PhaseResults],
    arm_descriptions: list[dict],
    baseline: str,
    run_info: dict,
    args: argparse.Namespace,
    log_dir: Path,
    per_round: list[tuple[Workload, dict[str, PhaseResults]]] | None = None,
) -> tuple[Path, str]:
    """results.json, results.md and plots; with rounds, the pooled table and one per round."""
    out_dir = results_dir(args.output_root, workload.name)
    bound = run_info.get("bound_tok_s")
    rows = report.build_rows(workload, arm_results, baseline, bound)
    round_rows = [report.build_rows(w, r, baseline, bound) for w, r in per_round or []]
    columns = report.columns_for(workload)
    written_plots: list[str] = []
    plot_error = None
    if not args.no_plots and arm_results:
        try:
            written_plots = plots.plot(workload, arm_results, rows, out_dir)
        except ImportError as exc:
            plot_error = f"no plots: {exc} (pip install matplotlib)"
            print(plot_error, file=sys.stderr)
    document = {
        "workload": workload.name,
        "params": {k: v for k, v in workload.params.items() if k != "warmup_prompts"},
        "baseline": baseline,
        **run_info,
        "arms": arm_descriptions,
        "table": {
            "columns": [{"key": c.key, "header": c.header, "ratio": c.ratio} for c in columns],
            "rows": rows,
        },
        "phases": _phases_json(arm_results),
        "plots": written_plots,
        "plot_error": plot_error,
        "rounds": [{"rows": r} for r in round_rows],
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=1))
    for log in log_dir.glob("*.log"):
        shutil.copy(log, out_dir / log.name)
    markdown = render_markdown(
        workload, columns, rows, arm_descriptions, baseline, run_info, written_plots, round_rows
    )
    (out_dir / "results.md").write_text(markdown)
    return out_dir, markdown


def _phases_json(arm_results: dict[str, PhaseResults]) -> dict[str, dict]:
    """{arm: {phase: {"summary": ..., "requests": [...]}}} for results.json."""
    return {
        arm: {
            label: {
                "summary": summarize(results, duration_s),
                "requests": [r.to_json() for r in results],
            }
            for label, (results, duration_s) in phases.items()
        }
        for arm, phases in arm_results.items()
    }


def _sampling_note(temperature: float) -> str:
    if temperature == 0:
        return (
            "All requests greedy (temperature 0); 'greedy outputs' counts prompts both arms "
            "finished with identical text (bf16 numerics and batching may legitimately differ)."
        )
    return (
        f"All requests sampled at temperature {temperature:g}: 'greedy outputs' (prompts both "
        "arms finished with identical text) means nothing here."
    )


def render_markdown(
    workload: Workload,
    columns: list[Column],
    rows: list[dict],
    arm_descriptions: list[dict],
    baseline: str,
    run_info: dict,
    plot_names: list[str],
    round_rows: Sequence[list[dict]] = (),
) -> str:
    """results.md: model, machine and workload, the arms, the table (pooled and per round)."""
    results_heading = f"## Results (ratios: arm ÷ {baseline})"
    if round_rows:
        results_heading = f"## Results, {len(round_rows)} rounds pooled (ratios: arm ÷ {baseline})"
    lines = [
        *_preamble_lines(workload, run_info),
        "",
        "## Arms",
        "",
        report.markdown_table(report.ARM_COLUMNS, arm_descriptions),
        "",
        results_heading,
        "",
        report.markdown_table(columns, rows, baseline),
        "",
        "TTFT: to the first chunk with non-empty `choices`. ITL: between chunks that carry text. "
        "TPOT: (e2e − TTFT) / (output tokens − 1). Output tokens from `usage`. "
        + _sampling_note(run_info.get("temperature", 0.0)),
    ]
    if round_rows:
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
    if plot_names:
        lines += ["", *[f"![{name}]({name})" for name in plot_names]]
    return "\n".join(lines) + "\n"


def _preamble_lines(workload: Workload, run_info: dict) -> list[str]:
    """Title, model, machine, workload parameters and the command that ran."""
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
    if run_info.get("background_load", "none") != "none":
        machine_line += f"; background load while each arm ran: {run_info['background_load']}"
    return [
        f"# {workload.name} — {run_info['date']}",
        "",
        model_line + ".",
        machine_line + ".",
        f"Workload: {params}; seed {run_info['seed']}; "
        f"{run_info['num_warmup']} warm-up requests per arm and workload, not counted.",
        f"Command: `{run_info['command']}`",
    ]
