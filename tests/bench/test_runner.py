"""The bench's runner: how SIGTERM and SIGHUP end a run (servers are stopped by its `finally`s)."""

import argparse
import asyncio
import os
import signal
import subprocess
import time

import pytest

from nanoserve.bench import runner
from nanoserve.bench.runner import signals_end_the_run
from nanoserve.bench.workloads import Phase


def send_later(signum: int, delay_s: float = 0.2) -> subprocess.Popen:
    """`signum` to this process in `delay_s`, from another process (a thread of this one could
    wait long for the interpreter lock while the test's event loop spins)."""
    command = f"sleep {delay_s}; kill -{signum} {os.getpid()}"
    return subprocess.Popen(["sh", "-c", command])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_requests_are_measured_cancels_them_then_interrupts(signum: int) -> None:
    """Inside the event loop the measuring task is cancelled at its next `await` (it unwinds
    through its own `finally`s, as on Ctrl-C), and only then does the run end by
    KeyboardInterrupt; an interrupt raised in the middle of the task's code could be lost (in a
    callback) or wrapped (by a task group) on its way out."""
    seen: list[BaseException] = []
    senders = []

    async def measuring() -> None:
        senders.append(send_later(signum))  # once asyncio.run's own handler is in place
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # reading responses: the task's code runs
                sum(range(100_000))
                await asyncio.sleep(0)
        except BaseException as exc:
            seen.append(exc)
            raise

    with pytest.raises(KeyboardInterrupt), signals_end_the_run():
        asyncio.run(measuring())
    assert senders[0].wait(timeout=10) == 0
    assert [type(exc) for exc in seen] == [asyncio.CancelledError]


def test_a_signal_outside_the_event_loop_interrupts_and_the_handlers_come_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), signals_end_the_run():
        sender = send_later(signal.SIGTERM)
        time.sleep(30)  # a server starting
    assert sender.wait(timeout=10) == 0
    assert time.monotonic() - started < 20
    assert {s: signal.getsignal(s) for s in before} == before


def test_every_request_of_a_phase_carries_the_runs_temperature(monkeypatch) -> None:
    sent: list[dict] = []

    async def fake_phase(url, bodies, *rest):
        sent.extend(bodies)
        return [], 0.0

    monkeypatch.setattr(runner, "run_phase", fake_phase)
    args = argparse.Namespace(temperature=0.7, seed=0, request_timeout_s=1.0)
    phase = Phase("c=1", ["a prompt", "another"], max_tokens=4)
    runner._run_phase("http://127.0.0.1:1/v1/completions", "m", phase, args, "label")
    assert [body["temperature"] for body in sent] == [0.7, 0.7]
