"""PNG plots of a workload's results (matplotlib, imported only when plots are drawn)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

from nanoserve.bench.client import PhaseResults
from nanoserve.bench.metrics import summarize
from nanoserve.bench.workloads import Workload


def plot(
    workload: Workload,
    arm_results: dict[str, PhaseResults],
    rows: list[dict],
    out_dir: Path,
) -> list[str]:
    """PNG plots: output throughput (all streams together, and each stream) and TTFT p50/p99
    against concurrency (where there are several levels), and the TTFT distribution of every
    arm. Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")

    written = []
    levels = [p.params.get("concurrency") for p in workload.phases]
    if len(levels) > 1 and all(levels):
        concurrency_levels = cast("list[int]", levels)  # all() above: every phase has one
        written += _plot_against_concurrency(workload, arm_results, concurrency_levels, out_dir)
    written.append(_plot_ttft_distribution(workload, arm_results, out_dir))
    return written


# The two throughputs the tables show, as the throughput plot names them: every stream's output
# tokens over the phase's wall time (sweep's "output tok/s", scoreboard's "N streams: total
# tok/s"), and each request's tokens over its own time, averaged (scoreboard's "single-stream
# tok/s" at concurrency 1, "N streams: tok/s each" beyond).
THROUGHPUTS = {
    "all streams": "output_throughput",
    "each stream": "per_stream_tok_s_mean",
}
THROUGHPUT_NOTE = (
    "all streams: output tokens / phase time; each stream: a request's tokens / its time, mean"
)


def throughput_series(
    workload: Workload, arm_results: dict[str, PhaseResults]
) -> dict[str, dict[str, list[float]]]:
    """{arm: {"all streams": [...], "each stream": [...]}}, one value per phase (concurrency
    level), computed as the tables compute them (NaN, a gap in the line, where none was)."""
    series: dict[str, dict[str, list[float]]] = {}
    for arm, phases in arm_results.items():
        summaries = [summarize(*phases[p.label]) for p in workload.phases]
        series[arm] = {
            name: [math.nan if s[key] is None else s[key] for s in summaries]
            for name, key in THROUGHPUTS.items()
        }
    return series


def _plot_against_concurrency(
    workload: Workload, arm_results: dict[str, PhaseResults], levels: list[int], out_dir: Path
) -> list[str]:
    """Output throughput (all streams and each stream) and TTFT p50/p99 of every arm at each
    concurrency level."""
    import matplotlib.pyplot as plt

    written = []
    fig_tp, ax_tp = plt.subplots(figsize=(6, 4.4))
    fig_ttft, ax_ttft = plt.subplots(figsize=(6, 4))
    for arm, throughputs in throughput_series(workload, arm_results).items():
        (total,) = ax_tp.plot(
            levels, throughputs["all streams"], marker="o", label=f"{arm}: all streams"
        )
        ax_tp.plot(
            levels,
            throughputs["each stream"],
            marker="x",
            linestyle="--",
            color=total.get_color(),
            label=f"{arm}: each stream",
        )
    fig_tp.text(0.5, 0.01, THROUGHPUT_NOTE, ha="center", fontsize=7)
    for arm, phases in arm_results.items():
        summaries = [summarize(*phases[p.label]) for p in workload.phases]
        (line,) = ax_ttft.plot(
            levels, [s["ttft_ms"]["p50"] for s in summaries], marker="o", label=f"{arm} p50"
        )
        ax_ttft.plot(
            levels,
            [s["ttft_ms"]["p99"] for s in summaries],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{arm} p99",
        )
    ax_ttft.set_yscale("log")  # queueing makes TTFT span orders of magnitude
    for ax, fig, ylabel, name in (
        (ax_tp, fig_tp, "output tokens/s", "throughput_vs_concurrency.png"),
        (ax_ttft, fig_ttft, "time to first token (ms)", "ttft_vs_concurrency.png"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{workload.name}: {ylabel} against concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout(rect=(0, 0.04, 1, 1))  # room for the throughput plot's note
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        written.append(name)
    return written


def _plot_ttft_distribution(
    workload: Workload, arm_results: dict[str, PhaseResults], out_dir: Path
) -> str:
    """The cumulative distribution of every arm's TTFT over all phases."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, phases in arm_results.items():
        ttfts = sorted(
            r.ttft_s * 1000
            for results, _ in phases.values()
            for r in results
            if r.is_ok and r.ttft_s is not None
        )
        if ttfts:
            fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, fractions, where="post", label=f"{arm} ({len(ttfts)} requests)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{workload.name}: TTFT distribution (all phases)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_distribution.png", dpi=120)
    plt.close(fig)
    return "ttft_distribution.png"
