"""No child outlives the test session: the processes tests start are found and named at its end.

The pytest process makes itself a child subreaper (Linux), so that a process orphaned by the
death of its parent (a benchmark's server whose harness was killed, a worker whose front was)
becomes its child instead of init's, and is found here too. Zombies are dead: they do not count.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 10.0  # for children that are exiting as the session ends
# Helpers that Python and torch start in this process and end when it exits.
OWNED_BY_THE_INTERPRETER = ("multiprocessing.resource_tracker", "torch._inductor.compile_worker")


def become_subreaper() -> None:
    """Orphaned descendants become children of this process (no-op off Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def live_children() -> dict[int, str]:
    """This process's children that are not zombies: pid -> command line."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it exited meanwhile
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if int(parent) == os.getpid() and state != "Z":
            children[int(entry.name)] = command.strip()
    return {
        pid: command
        for pid, command in children.items()
        if not any(helper in command for helper in OWNED_BY_THE_INTERPRETER)
    }


def leftover_children(grace_s: float = GRACE_S) -> dict[int, str]:
    """Children still alive after `grace_s` (those exiting now get that long)."""
    deadline = time.monotonic() + grace_s
    while (children := live_children()) and time.monotonic() < deadline:
        time.sleep(0.1)  # paces the poll
    return children


def fail_the_session_for_leftovers(session, grace_s: float = GRACE_S) -> None:
    """At the session's end (pytest_sessionfinish): name every child still alive after
    `grace_s`, end it, and fail the run."""
    leftovers = leftover_children(grace_s)
    if not leftovers:
        return
    lines = [f"  pid {pid}: {command[:500]}" for pid, command in sorted(leftovers.items())]
    message = "these child processes outlived the tests that started them:\n" + "\n".join(lines)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message)
    kill_all(list(leftovers))
    session.exitstatus = 1  # pytest.ExitCode.TESTS_FAILED


def kill_all(pids: list[int]) -> None:
    """SIGKILL these and, as they die, whatever of theirs comes to this process."""
    for _ in range(10):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)  # paces the rounds: orphans of the killed arrive here
        pids = list(live_children())
        if not pids:
            return
