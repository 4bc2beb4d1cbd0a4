"""The serving benchmark: its SSE client on canned streams, and the whole harness end to end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from nanoserve.bench.arms import ArmOptions, Server, parse_arm
from nanoserve.bench.client import RequestResult, completion_body, stream_completion
from nanoserve.bench.metrics import summarize
from nanoserve.bench.workloads import WORKLOADS, autocomplete


def _frame(choices: list, usage: dict | None = None) -> str:
    body = {"id": "x", "object": "text_completion", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def _text(text: str, finish: str | None = None) -> dict:
    return {"index": 0, "text": text, "finish_reason": finish}


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
GOOD_STREAM = (
    _frame([_text("a")])
    + ": keep-alive\n\n"
    + _frame([_text("b")])
    + _frame([_text("c", "length")])
    + _frame([], USAGE)
    + "data: [DONE]\n\n"
)


def _run(body: str, status: int = 200) -> RequestResult:
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream_options"] == {"include_usage": True}
        return httpx.Response(status, text=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        result = RequestResult(index=0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            request = completion_body("m", "hello", 3)
            await stream_completion(client, "http://test/v1/completions", request, result, 0.0)
        return result

    return asyncio.run(go())


def test_client_measures_a_good_stream():
    result = _run(GOOD_STREAM)
    assert result.error is None and result.is_ok
    assert result.text == "abc"
    assert (result.prompt_tokens, result.output_tokens) == (5, 3)
    assert result.finish_reason == "length"
    assert len(result.itl_s) == 2  # three text chunks, two gaps
    assert 0 <= result.ttft_s <= result.e2e_s
    assert result.tpot_s == pytest.approx((result.e2e_s - result.ttft_s) / 2)
    summary = summarize([result], duration_s=1.0)
    assert summary["num_completed"] == 1 and summary["num_errors"] == 0
    assert summary["output_throughput"] == 3.0


@pytest.mark.parametrize(
    ("body", "status", "error_start"),
    [
        ("boom", 500, "HTTP 500"),
        (_frame([_text("a")]) + 'data: {"error": {"message": "bad"}}\n\n', 200, "error frame"),
        (_frame([_text("a")]) + "event: error\ndata: {}\n\n", 200, "error frame"),
        (_frame([_text("a")]) + "data: {not json\n\n", 200, "frame is not JSON"),
        (_frame([_text("a")]) + _frame([], USAGE), 200, "stream ended without"),
        (_frame([_text("a")]) + "data: [DONE]\n\n", 200, "no usage"),
        (_frame([], USAGE) + "data: [DONE]\n\n", 200, "no chunk with choices"),
    ],
)
def test_client_counts_broken_streams_as_errors(body, status, error_start):
    result = _run(body, status)
    assert result.error is not None and result.error.startswith(error_start), result.error
    assert not result.is_ok
    assert summarize([result], duration_s=1.0)["num_errors"] == 1


def test_parse_arm():
    assert parse_arm("hf").kind == "hf"
    arm = parse_arm("url=sglang=http://127.0.0.1:30000/")
    assert (arm.name, arm.kind, arm.url) == ("sglang", "url", "http://127.0.0.1:30000")
    arm = parse_arm("cmd=llamacpp=llama-server -m {model} --port {port}")
    assert (arm.name, arm.command) == ("llamacpp", "llama-server -m {model} --port {port}")
    for bad in ("sglang", "url=x=ftp://h", "cmd=x=serve --port 8000", "url=x"):
        with pytest.raises(ValueError):
            parse_arm(bad)


@pytest.mark.parametrize("policy", [None, "PASSIVE"])
def test_every_arm_gets_the_same_threads_and_wait_policy(tmp_path, monkeypatch, policy):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's own setting never leaks in
    options = ArmOptions(
        threads=3, max_model_len=256, startup_timeout_s=1, log_dir=tmp_path, omp_wait_policy=policy
    )
    for spec in ("nanoserve", "hf", "cmd=other=serve --port {port}"):
        _, env, description = Server(parse_arm(spec), tmp_path, options)._launch()
        assert env["OMP_NUM_THREADS"] == "3"
        assert env.get("OMP_WAIT_POLICY") == policy
        assert description["omp_wait_policy"] == (policy or "server's default")


def test_autocomplete_debounce_and_prefixes(tmp_path):
    source = tmp_path / "f.py"
    source.write_text("def f(x):\n    return x + 1\n" * 4)
    slow = autocomplete(source, 10, 20, typing_cps=5.0, debounce_ms=50, max_tokens=10, seed=0)
    fast = autocomplete(source, 10, 20, typing_cps=5.0, debounce_ms=500, max_tokens=10, seed=0)
    (phase,) = slow.phases
    # At 5 chars/s every gap is ≥ 100 ms, so a 50 ms debounce fires after every keystroke.
    assert len(phase.prompts) == 20
    assert phase.prompts[0] == source.read_text()[:11]
    assert all(b.startswith(a) for a, b in zip(phase.prompts, phase.prompts[1:], strict=False))
    assert phase.send_times_s == sorted(phase.send_times_s)
    # A 500 ms debounce only fires at pauses (after newlines) and after the last keystroke.
    assert 1 <= len(fast.phases[0].prompts) < 20
    assert fast.phases[0].prompts[-1] == source.read_text()[:30]


@pytest.mark.slow
def test_harness_end_to_end(tmp_path):
    """Both arms, every workload, a few requests each: the JSON has every field the table shows."""
    out = tmp_path / "results"
    command = [
        sys.executable, "-m", "nanoserve.cli", "bench",
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


def test_rounds_salt_every_prompt_and_pool_in_order():
    """Each round's prompts start with words of their own; pooling keeps groups apart."""
    from nanoserve.bench.workloads import Phase, Workload, for_round, pooled

    base = Workload(
        "shared-prefix",
        [Phase("c=1", ["system. q1", "system. q2", "other. q3"], 4, groups=[0, 0, 1])],
        {},
    )
    rounds = [for_round(base, index) for index in range(3)]
    first_words = {w.phases[0].prompts[0].split(".")[0] for w in rounds}
    assert len(first_words) == 3  # no prompt of one round prefixes one of another
    assert all(w.phases[0].prompts[0].endswith("system. q1") for w in rounds)
    assert base.phases[0].prompts == ["system. q1", "system. q2", "other. q3"]  # not mutated
    merged = pooled(rounds).phases[0]
    assert merged.prompts == [p for w in rounds for p in w.phases[0].prompts]
    assert merged.groups == [0, 0, 1, 2, 2, 3, 4, 4, 5]


@pytest.mark.slow
def test_harness_rounds_end_to_end(tmp_path):
    """--rounds 2: both servers up at once, one pooled table plus one table per round."""
    out = tmp_path / "results"
    command = [
        sys.executable, "-m", "nanoserve.cli", "bench",
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
