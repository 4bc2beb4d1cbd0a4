"""The session-end check (tests/conftest.py): a process a test leaves behind, even one orphaned
by its parent's death, fails the run, is named by its command line, and is ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).parent
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
from leftover_processes import become_subreaper, fail_the_session_for_leftovers

def pytest_configure(config):
    become_subreaper()

def pytest_sessionfinish(session, exitstatus):
    fail_the_session_for_leftovers(session, grace_s=0.5)
"""
LEAKY_TEST = """
import subprocess

def test_leaves_an_orphan():
    # The shell exits at once; its background sleep loses its parent.
    subprocess.run(["bash", "-c", "sleep 417 >/dev/null 2>&1 &"], check=True)

def test_cleans_up():
    process = subprocess.Popen(["sleep", "418"])
    process.kill()
    process.wait()
"""


def run_session(tmp_path: Path, tests: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_it.py").write_text(tests)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # a bare pytest starts faster
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def sleeps_alive(seconds: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"sleep {seconds}"], capture_output=True, text=True)
    return found.stdout.split()


def test_an_orphan_left_behind_fails_the_run_and_is_ended(tmp_path: Path) -> None:
    run = run_session(tmp_path, LEAKY_TEST)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "2 passed" in run.stdout
    assert "these child processes outlived the tests that started them" in run.stdout
    assert "sleep 417" in run.stdout and "sleep 418" not in run.stdout
    assert sleeps_alive("417") == []


def test_a_session_that_ends_its_processes_passes(tmp_path: Path) -> None:
    tidy = "import subprocess\n\ndef test_cleans_up" + LEAKY_TEST.split("def test_cleans_up")[1]
    run = run_session(tmp_path, tidy)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "outlived" not in run.stdout
