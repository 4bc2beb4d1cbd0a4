"""A real `nanoserve serve`'s start-up: each stage is logged as it starts and the ready line
times every one; Ctrl-C (once or twice) while the model loads ends the server at once, its
worker killed rather than waited for."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from servers import ServerProcess, child_pids, free_port

from nanoserve.client.zmq_engine_client import startup_breakdown
from nanoserve.common.protocol import Ready

# The worker's stage lines, in the order they must appear (the engine logs the middle ones).
STAGE_LINES = (
    "worker: importing torch and the engine",
    "worker: imports took ",
    "worker: weights in ",
    "worker: layers prepared in ",
    "worker: KV cache and step runners took ",
    "nanoserve.server: worker ",  # ... ready in
)
BREAKDOWN = (
    "process start",
    "imports",
    "fast paths",
    "weights",
    "linear methods",
    "KV cache and step runners",
    "warm-up",
)
# With this grace, a front that waited for a loading worker to read its Shutdown message (as it
# did) would take a minute to exit; one that kills it takes about a second.
SHUTDOWN_TIMEOUT_S = 60
EXIT_DEADLINE_S = 20  # beyond it the front waited for the worker: broken, not slow


def test_the_breakdown_names_every_stage_in_order() -> None:
    times = {"load_time_s": 0.5, "kv_sizing_time_s": 0.25, "warmup_time_s": 1.0}
    times |= {"prepare_time_s": 0.125, "imports_time_s": 2.0, "setup_time_s": 3.0}
    ready = Ready(pid=7, max_model_len=64, vocab_size=256, num_kv_blocks=16, block_size=16, **times)
    assert startup_breakdown(ready, elapsed_s=7.5) == (
        "7.5 s (process start 0.62 s, imports 2.00 s, fast paths 3.00 s, weights 0.50 s, "
        "linear methods 0.12 s, KV cache and step runners 0.25 s, warm-up 1.00 s)"
    )


@pytest.mark.slow
def test_each_start_up_stage_is_logged_as_it_starts_and_timed(tmp_path: Path) -> None:
    with ServerProcess(None, tmp_path / "server.log", "--log-level", "info") as server:
        server.wait_healthy()
        log = server.log_path.read_text()
    positions = [log.find(line) for line in STAGE_LINES]
    assert -1 not in positions and positions == sorted(positions), (positions, log)
    ready = re.search(r"ready in ([\d.]+) s \((.*?)\); KV cache", log)
    assert ready, log
    stages = [part.rsplit(" ", 2) for part in ready.group(2).split(", ")]
    assert [name for name, _, _ in stages] == list(BREAKDOWN)
    seconds = [float(value) for _, value, unit in stages if unit == "s"]
    assert len(seconds) == len(BREAKDOWN) and min(seconds) >= 0
    assert abs(sum(seconds) - float(ready.group(1))) < 0.1  # the parts make the whole


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("num_ctrl_c", [1, 2])
def test_ctrl_c_while_the_model_loads_exits_at_once(tmp_path: Path, num_ctrl_c: int) -> None:
    """The worker is stopped (SIGSTOP) as soon as it exists: a worker busy loading, which reads
    no message. Ctrl-C, then (a second time) again: the front kills it and exits."""
    flags = ("--log-level", "info", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    server = ServerProcess(None, tmp_path / "server.log", *flags)
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not (workers := child_pids(server.process.pid)):
            assert server.process.poll() is None, server.log()
            assert time.monotonic() < deadline, "no worker started"
            time.sleep(0.01)  # paces the poll
        [worker] = workers
        os.kill(worker, signal.SIGSTOP)
        while health(server.url) != 503:  # listening, and not ready: the model "loads"
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)  # paces the poll
        interrupted_at = time.monotonic()
        for _ in range(num_ctrl_c):
            server.process.send_signal(signal.SIGINT)
            time.sleep(0.1)  # a person's second Ctrl-C comes later still
        assert server.process.wait(timeout=EXIT_DEADLINE_S) == 0, server.log()
        exit_s = time.monotonic() - interrupted_at
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)  # if the front left it: the test fails below
        server.stop()
    assert not Path(f"/proc/{worker}").exists(), "the worker outlived the front"
    log = server.log_path.read_text()
    assert "stopping the model worker, which was still starting" in log
    assert "Traceback" not in log and "ready in" not in log, log
    assert exit_s < EXIT_DEADLINE_S


def test_ctrl_c_before_the_server_serves_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the front still imports or checks (uvicorn handles it from then on)."""
    import nanoserve.cli.main as cli

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_serve", interrupted)
    assert cli.main(["serve"]) == 130
    assert capsys.readouterr().err == "nanoserve serve: interrupted\n"


@pytest.mark.parametrize("failure", [ValueError("no tokenizer here"), KeyboardInterrupt()])
def test_the_worker_starts_before_the_tokenizer_loads_and_dies_with_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failure: BaseException
) -> None:
    """The front launches the worker first, so that its imports and model load overlap the
    front's tokenizer; a tokenizer that fails (or Ctrl-C then) leaves no worker behind."""
    import nanoserve.cli.main as cli

    workers_while_loading: list[int] = []

    def worker_children() -> list[int]:
        workers = []
        for pid in child_pids(os.getpid()):
            with contextlib.suppress(OSError):
                if b"nanoserve.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    workers.append(pid)
        return workers

    def failing_tokenizer(args: object, model_dir: Path) -> None:
        deadline = time.monotonic() + 10.0  # /proc can lag the spawn on a busy machine
        while not (workers := worker_children()) and time.monotonic() < deadline:
            time.sleep(0.02)
        workers_while_loading.extend(workers)
        raise failure

    monkeypatch.setattr(cli, "_load_front_tokenizer", failing_tokenizer)
    code = cli.main(["serve", "--host", "127.0.0.1", "--port", str(free_port())])
    assert code == (2 if isinstance(failure, ValueError) else 130)
    if isinstance(failure, ValueError):
        assert capsys.readouterr().err == "nanoserve serve: no tokenizer here\n"
    assert len(workers_while_loading) == 1
    assert not Path(f"/proc/{workers_while_loading[0]}").exists()  # killed and reaped
