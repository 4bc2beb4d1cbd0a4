#!/usr/bin/env bash
# Install nanoserve from this checkout into the current Python environment (activate a virtual
# environment first: python3 -m venv .venv && . .venv/bin/activate): torch, then
# `pip install -e .[EXTRAS]`, then the C++ CPU kernels, compiled once for this install.
#
#   scripts/install.sh        # to serve
#   scripts/install.sh dev    # to run the tests and the linters too: the test tools at the
#                             # versions dev-constraints.txt pins (known to pass together)
#
# torch: a torch that imports already is kept. Otherwise, with an NVIDIA GPU (nvidia-smi), PyPI's
# default torch, which is the CUDA build; without one, the CPU build: the wheel pip would pick if
# it already is a CPU build (a local wheel or a CPU index in pip's configuration), else from
# PyTorch's CPU index, so that a CPU-only machine never downloads the multi-gigabyte CUDA build.
#
# The CPU kernels (nanoserve/platforms/cpu/csrc, for this CPU) are built into this environment's
# own folder, about a minute the first time and nothing after, so that no server start waits on
# a compiler. NANOSERVE_CPU_KERNELS=0 skips them; without a C++ compiler, a warning says so and
# nanoserve runs on PyTorch's ops.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
TORCH=torch==2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

pip_would_pick_a_cpu_torch() {
  "$PYTHON" -m pip install --dry-run --ignore-installed --no-deps --quiet --report - "$TORCH" 2>/dev/null |
    "$PYTHON" -c 'import json, sys; v = json.load(sys.stdin)["install"][0]["metadata"]["version"]; sys.exit(0 if v.endswith("+cpu") else 1)'
}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PYTHON" -m pip install "$TORCH"
  elif pip_would_pick_a_cpu_torch; then
    "$PYTHON" -m pip install "$TORCH"
  else
    "$PYTHON" -m pip install "$TORCH" --index-url "$CPU_INDEX"
  fi
fi

# The test tools are pinned (dev-constraints.txt); runtime dependencies keep pyproject's ranges.
if [ "${1:-}" = dev ]; then
  "$PYTHON" -m pip install -c dev-constraints.txt -e ".[dev]"
else
  "$PYTHON" -m pip install -e ".${1:+[$1]}"
fi

# Build the CPU kernels now, into this install's folder (a no-op when they are built already).
"$PYTHON" -m nanoserve.platforms.cpu.kernels
