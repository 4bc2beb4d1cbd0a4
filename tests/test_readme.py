"""The README's commands are real: CI runs its test command; the quick start works as written."""

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S)


def readme_test_command() -> str:
    for block in code_blocks(README):
        for line in block.splitlines():
            if "pytest" in line:
                return line.split("#")[0].strip()
    raise AssertionError("the README gives no test command")


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_test_command() == "python -m pytest tests"
    assert readme_test_command() in ci_lines


def quick_start_curls() -> list[list[str]]:
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    curls = [
        line
        for block in code_blocks(quick_start)
        for line in block.splitlines()
        if line.startswith("curl ")
    ]
    assert len(curls) >= 2, "the quick start should show a completion and a chat request"
    return [shlex.split(line) for line in curls]


@pytest.mark.slow
def test_quick_start_serves_the_demo_model_and_answers_the_curl_examples(tmp_path):
    serve = shutil.which("nanoserve")
    assert serve, "the nanoserve console script is not installed (pip install -e .)"
    # Exactly `nanoserve serve` from the README, on a free port instead of 8000.
    server = ServerProcess(None, tmp_path / "server.log", command=[serve], test_flags=False)
    port = server.port
    try:
        server.wait_healthy()
        for argv in quick_start_curls():
            argv = [arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for arg in argv]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            body = json.loads(done.stdout)
            choice = body["choices"][0]
            text = (
                choice["text"]
                if body["object"] == "text_completion"
                else choice["message"]["content"]
            )
            assert text, body
            assert choice["finish_reason"] in ("stop", "length")
    finally:
        assert server.stop() == 0
