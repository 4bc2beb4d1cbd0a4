#!/usr/bin/env bash
# Install nanoserve from this checkout into the current Python environment (activate a virtual
# environment first if you want one): torch, then `pip install -e .[EXTRAS]`.
#
#   scripts/install.sh        # to serve
#   scripts/install.sh dev    # to run the tests and the linters too
#
# torch: a torch that imports already is kept. Otherwise, with an NVIDIA GPU (nvidia-smi), PyPI's
# default torch, which is the CUDA build; without one, the CPU build: the wheel pip would pick if
# it already is a CPU build (a local wheel or a CPU index in pip's configuration), else from
# PyTorch's CPU index, so that a CPU-only machine never downloads the multi-gigabyte CUDA build.
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
"$PYTHON" -m pip install -e ".${1:+[$1]}"
