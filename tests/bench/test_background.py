"""The bench's background load: parsed from its flag, running while an arm is measured, and
gone (every process) when the block ends, or on its own at its deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.bench.background import BackgroundLoad, parse_background_load, running


def test_the_flag_names_cores_and_memory_streams():
    assert parse_background_load("none") == BackgroundLoad()
    assert parse_background_load("cores=1") == BackgroundLoad(cpu_hogs=1)
    assert parse_background_load("cores=2,memory=1") == BackgroundLoad(2, 1)
    assert "1 busy-looping" in parse_background_load("cores=1").describe()
    for bad in ("cores", "cores=x", "disk=1"):
        with pytest.raises(ValueError, match="cores=N"):
            parse_background_load(bad)


def child_pids() -> set[int]:
    me = str(os.getpid())
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:
                children.add(int(entry))
    return children


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_hogs_work_while_the_block_runs_and_are_gone_after():
    before = child_pids()
    with running(BackgroundLoad(cpu_hogs=1, memory_hogs=1)):
        hogs = child_pids() - before
        assert len(hogs) == 2
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and min(cpu_seconds(p) for p in hogs) < 0.2:
            time.sleep(0.05)
        assert min(cpu_seconds(p) for p in hogs) >= 0.2  # both are burning CPU
    assert child_pids() - before == set()


def test_a_hog_left_behind_ends_at_its_deadline():
    before = child_pids()
    with running(BackgroundLoad(cpu_hogs=1), max_seconds=0.3):
        (hog,) = child_pids() - before
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.waitpid(hog, os.WNOHANG) == (0, 0):
            time.sleep(0.05)  # polling for its exit, not pacing the test
        assert time.monotonic() < deadline, "the hog outlived its deadline"


ORPHANING_PARENT = """
import sys, time
from nanoserve.bench.background import BackgroundLoad, running
with running(BackgroundLoad(cpu_hogs=1, memory_hogs=1)):
    print("running", flush=True)
    time.sleep(600)
"""


def test_the_hogs_of_a_killed_benchmark_leave_with_it():
    """SIGKILL skips the block's cleanup: the hogs notice their parent is gone and exit (one
    was found spinning 14 minutes after its benchmark was killed)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHANING_PARENT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "running\n"
        hogs = [p for p in all_pids() if parent_of(p) == parent.pid]
        assert len(hogs) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while any(is_running(hog) for hog in hogs):
        assert time.monotonic() < deadline, "a hog outlived the benchmark that started it"
        time.sleep(0.05)  # polling for their exit, not pacing the test


def all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def is_running(pid: int) -> bool:
    """Alive and not a zombie (the session's subreaper, pytest, reaps orphans only later)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None
