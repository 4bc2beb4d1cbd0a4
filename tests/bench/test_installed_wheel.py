"""`nanoserve bench` works from a wheel installed away from the checkout, run from elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1"}

# Runs `nanoserve bench --help` in-process, then reports where nanoserve came from and whether
# anything of a `benchmarks` package was imported.
PROBE = """
import contextlib, io, json, sys
import nanoserve.cli.main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        nanoserve.cli.main.main(["bench", "--help"])
    except SystemExit:
        pass
benchmarks = [name for name in sys.modules if name.split(".")[0] == "benchmarks"]
print(json.dumps({"file": nanoserve.cli.main.__file__, "benchmarks": benchmarks}))
"""


def _build_wheel(tmp_path: Path) -> Path:
    """A wheel of the package alone: pyproject.toml, README.md and nanoserve/, nothing else."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "nanoserve", source / "nanoserve", ignore=ignore)
    dist = tmp_path / "dist"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    build = subprocess.run(
        [*command, "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        env=PIP_ENV,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("nanoserve-*.whl")
    return wheel


@pytest.mark.slow
def test_bench_help_from_an_installed_wheel(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "nanoserve/bench/serve_bench.py" in names
    assert not [name for name in names if name.startswith("benchmarks/")]

    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        env=PIP_ENV,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]

    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, not this checkout
    run = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli.main", "bench", "--help"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--workload" in run.stdout

    probe = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.splitlines()[-1])
    assert Path(found["file"]).is_relative_to(site)
    assert found["benchmarks"] == []
