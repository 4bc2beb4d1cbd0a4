"""Background load: the busy machine users live on, as a bench option (`--background-load`).

`cores=N` runs N processes that each keep one core busy (a Python loop, as an IDE or a build
would); `memory=N` runs N processes that stream a 256 MB buffer through memory over and over
(stress-ng's memory traffic). They run while each arm is measured, warm-up included, and end
when it ends, however it ends: each is killed by process group, and each also exits on its own
once the process that started it is gone or after `max_seconds` (so a killed benchmark cannot
leave them spinning).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# Each hog checks every so often the clock and its parent, and leaves at its deadline or once
# the process that started it (argv[2], named by that process: one killed while the hog starts
# would have been replaced by the time the hog could ask) is gone, its `finally` never run.
CPU_HOG = """
import os, sys, time
deadline, parent = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(100_000):
        pass
"""
MEMORY_HOG = """
import os, sys, time
import numpy as np
deadline, parent = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])
source = np.ones(32 << 20)  # 256 MB of float64
target = np.empty_like(source)
while time.monotonic() < deadline and os.getppid() == parent:
    np.copyto(target, source)
"""
DEFAULT_MAX_SECONDS = 4 * 3600.0


@dataclass(frozen=True)
class BackgroundLoad:
    """How many processes keep a core busy, and how many stream memory."""

    cpu_hogs: int = 0
    memory_hogs: int = 0

    @property
    def is_idle(self) -> bool:
        return self.cpu_hogs == 0 and self.memory_hogs == 0

    def describe(self) -> str:
        if self.is_idle:
            return "none"
        parts = [f"{self.cpu_hogs} busy-looping process(es)"] if self.cpu_hogs else []
        if self.memory_hogs:
            parts.append(f"{self.memory_hogs} memory-streaming process(es)")
        return " and ".join(parts)


def parse_background_load(text: str) -> BackgroundLoad:
    """`cores=N`, `memory=N`, or both comma-separated (`cores=1,memory=1`); `none`."""
    if text in ("", "none"):
        return BackgroundLoad()
    counts = {"cores": 0, "memory": 0}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in counts or not value.isdigit():
            raise ValueError(
                f"--background-load takes cores=N and/or memory=N (e.g. cores=1), got {text!r}"
            )
        counts[key] = int(value)
    return BackgroundLoad(cpu_hogs=counts["cores"], memory_hogs=counts["memory"])


@contextlib.contextmanager
def running(load: BackgroundLoad, max_seconds: float = DEFAULT_MAX_SECONDS) -> Iterator[None]:
    """Run `load` for the duration of the block; every process is gone when it ends."""
    scripts = [CPU_HOG] * load.cpu_hogs + [MEMORY_HOG] * load.memory_hogs
    processes = []
    try:
        for script in scripts:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", script, str(max_seconds), str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own group: killed whole, never by Ctrl-C
                )
            )
        yield
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
