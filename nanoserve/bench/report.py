"""Tables: one row per arm (the JSON's rows), ratios to the baseline, greedy-output comparison,
rendered as markdown."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.bench.client import PhaseResults, RequestResult
from nanoserve.bench.metrics import distribution_ms, summarize
from nanoserve.bench.workloads import Phase, Workload


@dataclass(frozen=True)
class Column:
    """A table column: a key of the JSON row, its header, and whether it gets a ratio."""

    key: str
    header: str
    digits: int = 1
    ratio: bool = False


COLUMNS: dict[str, list[Column]] = {
    "scoreboard": [
        Column("arm", "arm"),
        Column("ttft_p50_ms", "TTFT p50 ms (c=1)", ratio=True),
        Column("ttft_p99_ms", "TTFT p99 ms (c=1)"),
        Column("single_stream_tok_s", "single-stream tok/s", ratio=True),
        Column("decode_tok_s", "decode tok/s (1/TPOT, c=1)"),
        Column("decode_pct_of_bound", "% of bandwidth bound"),
        Column("concurrent_tok_s", "{c} streams: total tok/s", ratio=True),
        Column("concurrent_per_stream_tok_s", "{c} streams: tok/s each"),
        Column("num_errors", "errors", digits=0),
        Column("greedy_match", "greedy outputs"),
    ],
    "sweep": [
        Column("arm", "arm"),
        Column("concurrency", "concurrency", digits=0),
        Column("request_throughput", "req/s", digits=2),
        Column("output_throughput", "output tok/s", ratio=True),
        Column("ttft_p50_ms", "TTFT p50 ms", ratio=True),
        Column("ttft_p99_ms", "TTFT p99 ms"),
        Column("itl_p50_ms", "ITL p50 ms"),
        Column("tpot_p50_ms", "TPOT p50 ms"),
        Column("tpot_p99_ms", "TPOT p99 ms"),
        Column("e2e_p50_ms", "e2e p50 ms"),
        Column("num_errors", "errors", digits=0),
        Column("greedy_match", "greedy outputs"),
    ],
    "autocomplete": [
        Column("arm", "arm"),
        Column("num_requests", "sent", digits=0),
        Column("num_finished", "finished", digits=0),
        Column("num_dropped", "dropped", digits=0),
        Column("num_answered", "first token", digits=0),
        Column("ttft_answered_p50_ms", "TTFT p50 ms (first token)", ratio=True),
        Column("ttft_answered_p99_ms", "TTFT p99 ms (first token)", ratio=True),
        Column("ttft_p50_ms", "TTFT p50 ms (finished)", ratio=True),
        Column("e2e_p50_ms", "e2e p50 ms (finished)"),
        Column("num_errors", "errors", digits=0),
        Column("greedy_match", "greedy outputs"),
    ],
    "shared-prefix": [
        Column("arm", "arm"),
        Column("ttft_p50_ms", "TTFT p50 ms", ratio=True),
        Column("ttft_p99_ms", "TTFT p99 ms"),
        Column("ttft_first_p50_ms", "TTFT p50 ms, first of group"),
        Column("ttft_rest_p50_ms", "TTFT p50 ms, rest of group", ratio=True),
        Column("output_throughput", "output tok/s", ratio=True),
        Column("num_errors", "errors", digits=0),
        Column("greedy_match", "greedy outputs"),
    ],
}

ARM_COLUMNS = [
    Column("name", "arm"),
    Column("server", "server"),
    Column("mode", "mode"),
    Column("threads", "threads", digits=0),
    Column("omp_wait_policy", "OMP_WAIT_POLICY"),
    Column("dtype", "dtype"),
    Column("version", "version"),
    Column("startup_s", "start-up s", digits=1),
    Column("status", "status"),
]


def columns_for(workload: Workload) -> list[Column]:
    concurrency = workload.params.get("concurrency", "")
    return [
        Column(c.key, c.header.format(c=concurrency), c.digits, c.ratio)
        for c in COLUMNS[workload.name]
    ]


def greedy_match(
    ours: list[RequestResult], reference: list[RequestResult] | None
) -> dict[str, int] | None:
    """How many prompts both arms finished, and how many of those got identical text."""
    if reference is None:
        return None
    pairs = [(a, b) for a, b in zip(ours, reference, strict=True) if a.is_ok and b.is_ok]
    return {"compared": len(pairs), "identical": sum(a.text == b.text for a, b in pairs)}


def _match_cell(matches: list[dict | None], arm: str, baseline: str) -> str:
    if arm == baseline:
        return "reference"
    present = [m for m in matches if m is not None]
    if not present:
        return f"not compared ({baseline} has no results)"
    identical = sum(m["identical"] for m in present)
    compared = sum(m["compared"] for m in present)
    return f"{identical}/{compared} same as {baseline}"


def build_rows(
    workload: Workload,
    arm_results: dict[str, PhaseResults],
    baseline: str,
    bound_tok_s: float | None,
) -> list[dict]:
    """One row per arm (per arm and concurrency for the sweep), with ratios to `baseline`."""
    rows: list[dict] = []
    reference = arm_results.get(baseline)
    for arm, phases in arm_results.items():
        summaries = {label: summarize(*phases[label]) for label in phases}
        matches = {
            label: greedy_match(phases[label][0], reference[label][0] if reference else None)
            for label in phases
        }
        if workload.name == "sweep":
            for phase in workload.phases:
                match = _match_cell([matches[phase.label]], arm, baseline)
                rows.append(
                    {**_sweep_row(arm, phase, summaries[phase.label]), "greedy_match": match}
                )
            continue
        if workload.name == "scoreboard":
            row = _scoreboard_row(arm, workload, summaries, bound_tok_s)
        elif workload.name == "autocomplete":
            row = _autocomplete_row(arm, summaries)
        else:
            row = _shared_prefix_row(arm, workload, phases, summaries)
        row["greedy_match"] = _match_cell(list(matches.values()), arm, baseline)
        rows.append(row)
    _add_ratios(rows, columns_for(workload), baseline)
    return rows


def _sweep_row(arm: str, phase: Phase, s: dict) -> dict:
    return {
        "arm": arm,
        "concurrency": phase.params["concurrency"],
        **_common(s),
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_throughput"],
        "itl_p50_ms": s["itl_ms"]["p50"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "tpot_p99_ms": s["tpot_ms"]["p99"],
    }


def _scoreboard_row(
    arm: str, workload: Workload, summaries: dict[str, dict], bound_tok_s: float | None
) -> dict:
    single, concurrent = (summaries[p.label] for p in workload.phases)
    decode = single["decode_tok_s_mean"]
    return {
        "arm": arm,
        "ttft_p50_ms": single["ttft_ms"]["p50"],
        "ttft_p99_ms": single["ttft_ms"]["p99"],
        "single_stream_tok_s": single["per_stream_tok_s_mean"],
        "decode_tok_s": decode,
        "decode_pct_of_bound": (100.0 * decode / bound_tok_s if decode and bound_tok_s else None),
        "concurrent_tok_s": concurrent["output_throughput"],
        "concurrent_per_stream_tok_s": concurrent["per_stream_tok_s_mean"],
        "num_errors": single["num_errors"] + concurrent["num_errors"],
    }


def _autocomplete_row(arm: str, summaries: dict[str, dict]) -> dict:
    (s,) = summaries.values()
    return {
        "arm": arm,
        **_common(s),
        "num_requests": s["num_requests"],
        "num_finished": s["num_completed"],
        "num_dropped": s["num_dropped"],
        "num_answered": s["num_answered"],
        "ttft_answered_p50_ms": s["ttft_answered_ms"]["p50"],
        "ttft_answered_p99_ms": s["ttft_answered_ms"]["p99"],
    }


def _shared_prefix_row(
    arm: str, workload: Workload, phases: PhaseResults, summaries: dict[str, dict]
) -> dict:
    """TTFT of each group's first prompt apart from the rest (which may hit a prefix cache)."""
    (phase,) = workload.phases
    results, _ = phases[phase.label]
    first_seen: set[int] = set()
    first: list[float] = []
    rest: list[float] = []
    for result, group in zip(results, phase.groups or [], strict=True):
        if result.is_ok:
            assert result.ttft_s is not None  # is_ok: the first chunk was timed
            (rest if group in first_seen else first).append(result.ttft_s)
        first_seen.add(group)
    (s,) = summaries.values()
    return {
        "arm": arm,
        **_common(s),
        "ttft_first_p50_ms": distribution_ms(first)["p50"],
        "ttft_rest_p50_ms": distribution_ms(rest)["p50"],
        "output_throughput": s["output_throughput"],
    }


def _common(summary: dict) -> dict:
    return {
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "e2e_p50_ms": summary["e2e_ms"]["p50"],
        "num_errors": summary["num_errors"],
    }


def _add_ratios(rows: list[dict], columns: list[Column], baseline: str) -> None:
    """row["ratios"][key] = row[key] / baseline row[key] (same concurrency for the sweep)."""
    by_key = {(r["arm"], r.get("concurrency")): r for r in rows}
    for row in rows:
        base = by_key.get((baseline, row.get("concurrency")))
        row["ratios"] = {}
        for column in columns:
            if not column.ratio:
                continue
            value = row.get(column.key)
            reference = base.get(column.key) if base else None
            row["ratios"][column.key] = value / reference if value and reference else None


def _cell(value, digits: int) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(columns: list[Column], rows: list[dict], baseline: str | None = None) -> str:
    headers = [c.header + (f" (× {baseline})" if c.ratio and baseline else "") for c in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            cell = _cell(row.get(column.key), column.digits)
            ratio = (row.get("ratios") or {}).get(column.key)
            if column.ratio and ratio is not None and row.get("arm") != baseline:
                cell += f" ({ratio:.2f}×)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
