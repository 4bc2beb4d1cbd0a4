"""`nanoserve bench` end to end: both arms, every workload, and --rounds, on the test preset."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.bench.workloads import WORKLOADS


@pytest.mark.slow
def test_harness_end_to_end(tmp_path):
    """Both arms, every workload, a few requests each: the JSON has every field the table shows."""
    out = tmp_path / "results"
    command = [
        sys.executable, "-m", "nanoserve.cli.main", "bench",
        "--workload", "all", "--arm", "nanoserve", "--arm", "hf",
        "--preset", "test", "--model-dir", str(tmp_path / "model"),
        "--output-root", str(out), "--num-warmup", "2",
        "--nanoserve-args=--enforce-eager",  # the eager default, named so the table says so
        "--scoreboard-prompts", "2", "--scoreboard-max-tokens", "4",
        "--scoreboard-concurrency", "2",
        "--concurrency", "1,2", "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
        "--autocomplete-context", "40", "--autocomplete-chars", "6", "--typing-cps", "40",
        "--num-groups", "2", "--prompts-per-group", "2", "--prefix-len", "48",
        "--question-len", "8", "--prefix-output-len", "3",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]

    for workload in WORKLOADS:
        (out_dir,) = out.glob(f"*-{workload}")
        document = json.loads((out_dir / "results.json").read_text())
        markdown = (out_dir / "results.md").read_text()
        assert [a["name"] for a in document["arms"]] == ["nanoserve", "hf"]
        assert all(a["status"] == "ok" for a in document["arms"])
        assert document["arms"][0]["mode"] == "eager (--enforce-eager)"
        # Every arm we start reports its seconds from launch to ready.
        assert all(0 < a["startup_s"] < 600 for a in document["arms"])
        assert document["baseline"] == "nanoserve"
        columns, rows = document["table"]["columns"], document["table"]["rows"]
        assert {row["arm"] for row in rows} == {"nanoserve", "hf"}
        for column in columns:
            assert column["header"] in markdown
            for row in rows:
                assert row.get(column["key"]) is not None, (workload, column["key"], row)
                if column["ratio"]:
                    assert row["ratios"][column["key"]] is not None, (workload, column["key"])
        for row in rows:
            assert row["num_errors"] == 0, (workload, row)
            expected = "reference" if row["arm"] == "nanoserve" else "same as nanoserve"
            assert expected in row["greedy_match"]
        for name in document["plots"]:
            assert (out_dir / name).stat().st_size > 0
        assert "ttft_distribution.png" in document["plots"]
        for arm in ("nanoserve", "hf"):
            for phase in document["phases"][arm].values():
                summary = phase["summary"]
                assert summary["num_errors"] == 0, summary["errors"]
                for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
                    assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
                if workload in ("sweep", "shared-prefix"):  # ignore_eos: exact lengths
                    max_tokens = document["params"].get("output_len")
                    assert all(r["output_tokens"] == max_tokens for r in phase["requests"])
    sweep_doc = json.loads(next(out.glob("*-sweep")).joinpath("results.json").read_text())
    assert "throughput_vs_concurrency.png" in sweep_doc["plots"]
    assert [r["concurrency"] for r in sweep_doc["table"]["rows"]] == [1, 2, 1, 2]


@pytest.mark.slow
def test_harness_rounds_end_to_end(tmp_path):
    """--rounds 2: both servers up at once, one pooled table plus one table per round."""
    out = tmp_path / "results"
    command = [
        sys.executable, "-m", "nanoserve.cli.main", "bench",
        "--workload", "scoreboard", "shared-prefix", "--arm", "nanoserve", "--arm", "hf",
        "--rounds", "2", "--preset", "test", "--model-dir", str(tmp_path / "model"),
        "--output-root", str(out), "--num-warmup", "1", "--no-plots",
        "--scoreboard-prompts", "2", "--scoreboard-max-tokens", "3",
        "--scoreboard-concurrency", "2",
        "--num-groups", "2", "--prompts-per-group", "2", "--prefix-len", "40",
        "--question-len", "8", "--prefix-output-len", "3",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stderr.count("[nanoserve] ready") == 1  # started once for both rounds
    # The order rotates: nanoserve first in round 1, hf first in round 2.
    order = [line.split(": ")[1] for line in run.stderr.splitlines() if line.startswith("round ")]
    assert order == ["nanoserve", "hf", "hf", "nanoserve"]
    for workload in ("scoreboard", "shared-prefix"):
        (out_dir,) = out.glob(f"*-{workload}")
        document = json.loads((out_dir / "results.json").read_text())
        markdown = (out_dir / "results.md").read_text()
        assert "2 rounds pooled" in markdown and "Round 2:" in markdown
        assert len(document["rounds"]) == 2
        for round_ in document["rounds"]:
            assert [row["arm"] for row in round_["rows"]] == ["nanoserve", "hf"]
        for phase in document["phases"]["nanoserve"].values():
            per_round = len(phase["requests"]) // 2
            assert per_round == (2 if workload == "scoreboard" else 4)
            assert phase["summary"]["num_errors"] == 0
        rows = document["table"]["rows"]
        assert all(row["num_errors"] == 0 for row in rows)
        assert "same as nanoserve" in rows[1]["greedy_match"]


def test_failing_arms_fail_fast_and_keep_their_logs(tmp_path):
    """A url= arm that answers nothing fails within --url-timeout-s, said in advance; a server
    that dies at start-up leaves its log where the message says it is."""
    from servers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    dying = "cmd=dying=python -c 'print(\"boom on port {port}\"); raise SystemExit(3)'"
    command = [
        sys.executable, "-m", "nanoserve.cli.main", "bench", "--workload", "scoreboard",
        "--arm", f"url=silent={url}", "--arm", dying, "--url-timeout-s", "3",
        "--preset", "test", "--model-dir", str(tmp_path / "model"),
        "--output-root", str(tmp_path / "results"), "--no-plots",
    ]  # fmt: skip
    started = time.monotonic()
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "[silent] waiting for it to answer, at most 3 s" in run.stderr
    assert f"arm silent did not answer at {url}/health or /v1/models within 3 s" in run.stderr
    assert "(--url-timeout-s)" in run.stderr
    log_path = re.search(r"arm dying exited with code 3 .*last lines of (\S+):", run.stderr)
    assert log_path, run.stderr[-3000:]
    assert "boom on port" in Path(log_path.group(1)).read_text()
    assert time.monotonic() - started < 120
