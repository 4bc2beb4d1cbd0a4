"""The plots show what the tables show: at every concurrency level, each throughput in a table is
a point of throughput_vs_concurrency.png, under a label that says which it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.bench import plots, report
from nanoserve.bench.client import PhaseResults, RequestResult
from nanoserve.bench.workloads import Phase, Workload, scoreboard


def finished(index: int, sent_s: float, e2e_s: float, num_tokens: int) -> RequestResult:
    """A request that streamed `num_tokens` tokens in `e2e_s` seconds, its first after 0.1 s."""
    gaps = [(e2e_s - 0.1) / (num_tokens - 1)] * (num_tokens - 1)
    return RequestResult(
        index,
        sent_s,
        ttft_s=0.1,
        e2e_s=e2e_s,
        itl_s=gaps,
        prompt_tokens=5,
        output_tokens=num_tokens,
        finish_reason="length",
        text="x" * num_tokens,
    )


def arm_results(speed: float) -> PhaseResults:
    """Concurrency 1: two requests one after the other, with a gap between them (so the phase's
    throughput and a stream's differ); concurrency 2: both at once, each slower."""
    one = [finished(0, 0.0, 1.0 / speed, 20), finished(1, 1.5 / speed, 1.0 / speed, 20)]
    two = [finished(0, 0.0, 1.6 / speed, 20), finished(1, 0.0, 1.6 / speed, 20)]
    return {"c=1": (one, 3.0 / speed), "c=2": (two, 1.7 / speed)}


def test_the_scoreboard_plot_has_each_throughput_of_its_table() -> None:
    workload = scoreboard(num_prompts=2, max_tokens=20, concurrency=2)
    results = {"nanoserve": arm_results(1.0), "hf": arm_results(0.5)}
    rows = {row["arm"]: row for row in report.build_rows(workload, results, "nanoserve", None)}
    series = plots.throughput_series(workload, results)
    for arm, row in rows.items():
        each_stream, all_streams = series[arm]["each stream"], series[arm]["all streams"]
        assert each_stream[0] == pytest.approx(row["single_stream_tok_s"])  # concurrency 1
        assert each_stream[1] == pytest.approx(row["concurrent_per_stream_tok_s"])
        assert all_streams[1] == pytest.approx(row["concurrent_tok_s"])
        assert all_streams[0] != pytest.approx(each_stream[0])  # two things, two labels


def test_the_sweep_plot_has_its_tables_output_throughput(tmp_path: Path) -> None:
    # The sweep's shape: one phase per concurrency level.
    phases = [Phase(f"c={c}", ["p", "q"], 20, params={"concurrency": c}) for c in (1, 2)]
    workload = Workload("sweep", phases, {})
    results = {"nanoserve": arm_results(1.0)}
    rows = report.build_rows(workload, results, "nanoserve", None)
    series = plots.throughput_series(workload, results)["nanoserve"]["all streams"]
    assert series == pytest.approx([row["output_throughput"] for row in rows])
    written = plots.plot(workload, results, rows, tmp_path)
    assert "throughput_vs_concurrency.png" in written
    assert (tmp_path / "throughput_vs_concurrency.png").stat().st_size > 0
