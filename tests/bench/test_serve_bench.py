"""`nanoserve bench` end to end: both arms, every workload, and --rounds, on the test preset."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.bench.workloads import WORKLOADS

BENCH = [sys.executable, "-m", "nanoserve.cli.main", "bench"]
# The same command in a process that writes every thread's stack to stderr on SIGUSR1, for the
# tests that fail when it takes too long to exit.
BENCH_WITH_STACK_DUMPS = [
    sys.executable,
    "-c",
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True);"
    " from nanoserve.cli.main import main; sys.exit(main(sys.argv[1:]))",
    "bench",
]
# A bench that prints nothing for this long is hung: each step (a server's start, a workload's
# phase) says when it begins and ends, and these runs' steps take seconds, minutes on a busy
# machine. A slow bench keeps printing; only a bench that never ends passes the whole bound.
SILENT_LIMIT_S = 600
BENCH_TIMEOUT_S = 3600
# An OpenAI-shaped server that is ready at once and never answers a completion; it writes its
# pid where the test reads it.
HANGING_SERVER = """
import http.server, json, os, sys, time
from pathlib import Path

Path(sys.argv[2]).write_text(str(os.getpid()))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": {}, "/v1/models": {"data": [{"id": "fake"}]}}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def do_POST(self):
        time.sleep(3600)

http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class BenchRun:
    """`nanoserve bench` as a subprocess; stop() ends it as a user would (SIGTERM), then kills."""

    def __init__(self, command: list[str], cwd: Path) -> None:
        self.stderr_path = cwd / "bench.stderr"
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr, text=True
            )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_or_dump_stacks(self, timeout_s: float) -> int:
        """Its exit code within `timeout_s`; else a failure that shows where each of its threads
        was (its stacks, dumped on SIGUSR1: see BENCH_WITH_STACK_DUMPS) and what it printed."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(2)  # for the dump to be written
            pytest.fail(f"still running after {timeout_s} s:\n{self.stderr[-6000:]}")

    def wait(self, silent_limit_s: float = SILENT_LIMIT_S) -> int:
        """Its exit code; once it has printed nothing for `silent_limit_s` or run for
        BENCH_TIMEOUT_S, it is stopped (its servers with it): a failure."""
        started = last_output = time.monotonic()
        size = 0
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.process.wait(timeout=1)
            now = time.monotonic()
            if self.stderr_path.stat().st_size != size:
                size, last_output = self.stderr_path.stat().st_size, now
            if now - last_output > silent_limit_s or now - started > BENCH_TIMEOUT_S:
                self.stop()
                silent_s, ran_s = now - last_output, now - started
                message = f"the bench hung (silent {silent_s:.0f} s, ran {ran_s:.0f} s)"
                raise AssertionError(f"{message}:\n{self.stderr[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the bench stops its servers, then exits
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run_bench(command: list[str], cwd: Path) -> tuple[int, str]:
    """Run the bench to its end; (exit code, stderr). Stopped however the test ends."""
    run = BenchRun(command, cwd)
    try:
        return run.wait(), run.stderr
    finally:
        run.stop()


@pytest.mark.slow
def test_harness_end_to_end(tmp_path):
    """Both arms, every workload, a few requests each: the JSON has every field the table shows."""
    out = tmp_path / "results"
    flags = shlex.split(
        "--workload all --arm nanoserve --arm hf --preset test --num-warmup 2"
        " --scoreboard-prompts 2 --scoreboard-max-tokens 4 --scoreboard-concurrency 2"
        " --concurrency 1,2 --num-prompts 2 --input-len 16 --output-len 4"
        " --autocomplete-context 40 --autocomplete-chars 6 --typing-cps 40"
        " --num-groups 2 --prompts-per-group 2 --prefix-len 48 --question-len 8"
        " --prefix-output-len 3"
    )
    # --enforce-eager is the default, named so that the table says so.
    places = ["--model-dir", str(tmp_path / "model"), "--output-root", str(out)]
    command = [*BENCH, *flags, *places, "--nanoserve-args=--enforce-eager"]
    returncode, stderr = run_bench(command, tmp_path)
    assert returncode == 0, stderr[-4000:]

    for workload in WORKLOADS:
        (out_dir,) = out.glob(f"*-{workload}")
        document = json.loads((out_dir / "results.json").read_text())
        markdown = (out_dir / "results.md").read_text()
        assert [a["name"] for a in document["arms"]] == ["nanoserve", "hf"]
        assert all(a["status"] == "ok" for a in document["arms"])
        assert document["arms"][0]["mode"] == "eager (--enforce-eager)"
        assert document["temperature"] == 0.0 and "All requests greedy" in markdown
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
    flags = shlex.split(
        "--workload scoreboard shared-prefix --arm nanoserve --arm hf --rounds 2 --preset test"
        " --num-warmup 1 --no-plots"
        " --scoreboard-prompts 2 --scoreboard-max-tokens 3 --scoreboard-concurrency 2"
        " --num-groups 2 --prompts-per-group 2 --prefix-len 40 --question-len 8"
        " --prefix-output-len 3"
    )
    places = ["--model-dir", str(tmp_path / "model"), "--output-root", str(out)]
    command = [*BENCH, *flags, *places]
    returncode, stderr = run_bench(command, tmp_path)
    assert returncode == 0, stderr[-4000:]
    assert stderr.count("[nanoserve] ready") == 1  # started once for both rounds
    # The order rotates: nanoserve first in round 1, hf first in round 2.
    order = [line.split(": ")[1] for line in stderr.splitlines() if line.startswith("round ")]
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
    flags = ["--workload", "scoreboard", "--url-timeout-s", "3", "--preset", "test", "--no-plots"]
    places = ["--model-dir", str(tmp_path / "model"), "--output-root", str(tmp_path / "results")]
    command = [*BENCH, *flags, *places, "--arm", f"url=silent={url}", "--arm", dying]
    started = time.monotonic()
    returncode, stderr = run_bench(command, tmp_path)
    assert returncode == 1, stderr[-3000:]
    assert "[silent] waiting for it to answer, at most 3 s" in stderr
    assert f"arm silent did not answer at {url}/health or /v1/models within 3 s" in stderr
    assert "(--url-timeout-s)" in stderr
    log_path = re.search(r"arm dying exited with code 3 .*last lines of (\S+):", stderr)
    assert log_path, stderr[-3000:]
    assert "boom on port" in Path(log_path.group(1)).read_text()
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("rounds", ["1", "2"])
def test_a_terminated_bench_stops_its_servers(tmp_path, rounds):
    """SIGTERM while a server is being measured: the bench ends it before it exits itself."""
    (tmp_path / "server.py").write_text(HANGING_SERVER)
    pid_file = tmp_path / "server.pid"
    arm = f"cmd=hanging={sys.executable} {tmp_path / 'server.py'} {{port}} {pid_file}"
    flags = ["--workload", "scoreboard", "--preset", "test", "--no-plots"]
    places = ["--model-dir", str(tmp_path / "model"), "--output-root", str(tmp_path / "results")]
    command = [*BENCH_WITH_STACK_DUMPS, *flags, *places, "--arm", arm, "--rounds", rounds]
    run = BenchRun(command, tmp_path)
    try:
        deadline = time.monotonic() + SILENT_LIMIT_S
        while "[hanging] ready at" not in run.stderr:
            assert run.process.poll() is None, run.stderr[-3000:]
            assert time.monotonic() < deadline, run.stderr[-3000:]
            time.sleep(0.05)  # paces the poll
        server_pid = int(pid_file.read_text())
        run.process.send_signal(signal.SIGTERM)  # its warm-up request hangs: mid-measurement
        assert run.wait_or_dump_stacks(timeout_s=60) == 130, run.stderr[-3000:]
    finally:
        run.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)  # ended and reaped by the bench, not left behind
    # One line, after the cleanup, instead of a traceback.
    assert run.stderr.splitlines()[-1] == "interrupted" and "Traceback" not in run.stderr, (
        run.stderr[-2000:]
    )


INTERRUPTED_BEFORE_A_PHASE_STARTS = """
import sys
from nanoserve.bench import serve_bench

async def phase() -> None:
    pass

def interrupted_run(*args):
    coroutine = phase()  # made, never started: the interrupt lands before asyncio.run runs it
    raise KeyboardInterrupt

serve_bench._run = interrupted_run
sys.exit(serve_bench.main(["--arm", "url=x=http://127.0.0.1:9", "--preset", "test"]))
"""


INTERRUPTED_INSIDE_A_REQUESTS_TASK = """
import asyncio, sys
from nanoserve.bench import serve_bench

async def request() -> None:
    raise KeyboardInterrupt  # as a signal lands inside a request's task

def interrupted_run(*args):
    loop = asyncio.new_event_loop()
    task = loop.create_task(request())
    loop.run_until_complete(asyncio.sleep(0.01))  # the task's interrupt leaves the loop

serve_bench._run = interrupted_run
sys.exit(serve_bench.main(["--arm", "url=x=http://127.0.0.1:9", "--preset", "test"]))
"""


INTERRUPTED_INSIDE_AN_EVENT_LOOPS_CONSTRUCTOR = """
import asyncio, sys
from nanoserve.bench import serve_bench

def interrupted_run(*args):
    real = asyncio.selector_events.BaseSelectorEventLoop._make_self_pipe

    def interrupted(self):  # as a signal lands before the loop has its self-pipe
        raise KeyboardInterrupt

    asyncio.selector_events.BaseSelectorEventLoop._make_self_pipe = interrupted
    try:
        asyncio.new_event_loop()
    finally:
        asyncio.selector_events.BaseSelectorEventLoop._make_self_pipe = real

serve_bench._run = interrupted_run
sys.exit(serve_bench.main(["--arm", "url=x=http://127.0.0.1:9", "--preset", "test"]))
"""


@pytest.mark.parametrize(
    "script",
    [
        INTERRUPTED_BEFORE_A_PHASE_STARTS,
        INTERRUPTED_INSIDE_A_REQUESTS_TASK,
        INTERRUPTED_INSIDE_AN_EVENT_LOOPS_CONSTRUCTOR,
    ],
)
def test_an_interrupt_anywhere_in_a_phase_is_still_one_line(script: str) -> None:
    """What the interrupt left (a coroutine never started, a task whose exception nobody read,
    a half-built event loop) is collected quietly before the line: each printed a warning or a
    traceback in CI, beside a busy core."""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 130 and run.stderr == "interrupted\n", run.stderr
