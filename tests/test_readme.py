"""The README's commands are real: CI runs its test command; the quick start works as written."""

import argparse
import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S)


def readme_command(name: str) -> str:
    """The first command in the README's code blocks that starts with `name`."""
    for block in code_blocks(README):
        for line in block.splitlines():
            if line.startswith(name):
                return line.split("#")[0].strip()
    raise AssertionError(f"the README gives no {name} command")


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_command("scripts/test.sh") == "scripts/test.sh"
    assert "scripts/test.sh" in ci_lines
    test_script = (ROOT / "scripts" / "test.sh").read_text().splitlines()
    assert "bash scripts/install.sh dev" in test_script
    pytest_line = 'exec "${PYTHON:-python}" -m pytest tests -n auto --dist loadfile "$@"'
    assert test_script[-1] == pytest_line


def test_the_serve_script_installs_then_serves():
    assert readme_command("scripts/serve.sh") == "scripts/serve.sh"
    serve_script = (ROOT / "scripts" / "serve.sh").read_text().splitlines()
    assert "bash scripts/install.sh" in serve_script
    assert serve_script[-1] == 'exec "${PYTHON:-python}" -m nanoserve.cli.main serve "$@"'


def venv_seeing_this_environment(venv: Path) -> Path:
    """A new virtual environment whose Python also sees the packages of the one running the
    tests (a .pth file naming its site-packages); `--system-site-packages` would see the base
    Python instead, which has no torch when the tests run inside a virtual environment."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    where = [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    done = subprocess.run(where, check=True, capture_output=True, text=True)
    ours = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    lines = [path for path in ours if Path(path).is_dir()]
    (Path(done.stdout.strip()) / "tests-environment.pth").write_text("\n".join(lines) + "\n")
    return python


@pytest.mark.slow
def test_the_install_script_keeps_torch_and_installs_the_command(tmp_path):
    """scripts/install.sh in a fresh virtual environment that sees this one's packages: the
    torch that imports is kept (nothing downloaded), nanoserve is installed editable, then the
    kernel build step runs (switched off here: test_kernels.py covers the build)."""
    python = venv_seeing_this_environment(tmp_path / "venv")
    assert subprocess.run([python, "-c", "import torch"]).returncode == 0
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")],
        env={**os.environ, "PYTHON": str(python), "NANOSERVE_CPU_KERNELS": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [installed] = re.findall(r"Installing collected packages: (.*)", done.stdout)
    assert "nanoserve" in installed.split(", ") and "torch" not in installed, installed
    assert done.stdout.rstrip().endswith("NANOSERVE_CPU_KERNELS=0: the CPU kernels are not built")
    version = subprocess.run(
        [tmp_path / "venv" / "bin" / "nanoserve", "--version"], capture_output=True
    )
    assert version.stdout.decode().startswith("nanoserve ")
    where = subprocess.run(
        [python, "-c", "import nanoserve; print(nanoserve.__file__)"], capture_output=True
    )
    assert where.stdout.decode().strip() == str(ROOT / "nanoserve" / "__init__.py")


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
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert [model["id"] for model in models] == ["nanoserve-demo"]
    finally:
        assert server.stop() == 0


def offline_example() -> str:
    section = README.split("## Offline use", 1)[1].split("\n## ", 1)[0]
    [example] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return example


@pytest.mark.slow
def test_the_offline_example_runs_as_written():
    done = subprocess.run(
        [sys.executable, "-c", offline_example()], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("def fib(n):") and lines[-1].endswith(("length", "stop"))


def test_the_flag_table_lists_every_serve_flag():
    from nanoserve.cli.main import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {
        flag
        for action in serve._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }
    table = README.split("## `nanoserve serve` flags", 1)[1].split("\n## ", 1)[0]
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `--")]
    in_table = {flag for cell in first_cells for flag in re.findall(r"`(--[a-z-]+)`", cell)}
    assert in_table == flags


def test_architecture_doc_links_stay_inside_the_repository():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert "://" not in target, target
        assert (ROOT / "docs" / target.split("#")[0]).resolve().is_relative_to(ROOT), target
        assert (ROOT / "docs" / target.split("#")[0]).exists(), target
    assert "/work/" not in text and "shared/" not in text
