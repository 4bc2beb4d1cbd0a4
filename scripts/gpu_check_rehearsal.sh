#!/usr/bin/env bash
# scripts/gpu_check.sh rehearsed on this CPU machine (CI runs it after the tests), so that the day
# a GPU is lent the check runs there. It makes a new virtual environment (in a temporary folder,
# removed after) holding only what the GPU machine has: Python and torch, triton, transformers,
# tokenizers, safetensors, huggingface_hub, httpx, prometheus-client, jinja2, numpy, pytest, at
# the versions the calling environment has (torch: the local CPU build). nanoserve is not
# installed there, as it is not on the GPU machine. Then it downloads, for this Python, the wheels
# the check carries (the list of the shared tools' gpu_wheels.sh) and runs gpu_check.sh on its
# --device cpu path with the tiny preset. Exits non-zero when the check fails.
#
#   bash scripts/gpu_check_rehearsal.sh        (PYTHON: the environment whose versions to copy)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The GPU machine's packages, pinned to the versions installed here.
image_packages=(torch triton transformers tokenizers safetensors huggingface_hub httpx
  prometheus-client jinja2 numpy pytest)
mapfile -t image_pins < <("$PYTHON" -c '
import sys
from importlib.metadata import version

for name in sys.argv[1:]:
    print(f"{name}=={version(name)}")
' "${image_packages[@]}")
# What travels with the check as wheels (no llguidance, no ninja: the GPU machine has neither).
carried_wheels=(fastapi uvicorn sse-starlette pyzmq msgspec)

echo "GPU check rehearsal: a new environment with ${image_pins[*]}"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "${image_pins[@]}"
"$work/venv/bin/python" -m pip download -q --only-binary=:all: -d "$work/wheels" \
  "${carried_wheels[@]}"

# gpu_check.sh runs python3: the new environment's, first on PATH. Its time limits are the GPU
# machine's; the tiny preset on 2 busy CPU cores takes 3-5 minutes, so it gets 10 (a limit that
# means stuck, not slow).
PATH="$work/venv/bin:$PATH" WHEELS="$work/wheels" OUT="$work/out" \
  GPU_BENCH_ARGS="--preset tiny --device cpu --model-dir $work/model" \
  GPU_TESTS_TIMEOUT_S=600 GPU_BENCH_TIMEOUT_S=600 bash scripts/gpu_check.sh
