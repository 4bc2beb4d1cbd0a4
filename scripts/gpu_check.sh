#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (see the device tool), in under 8 minutes, with no
# network there. That machine has Python 3.12 with torch, triton, transformers, httpx,
# prometheus-client, numpy and pytest; the rest of nanoserve's needs travel as wheels:
#
#   here, once:  echo /.whl/ >> .git/info/exclude && bash ../shared/tools/gpu_wheels.sh .whl
#   there:       bash scripts/gpu_check.sh          (carry .whl; results land in $OUT)
#
# It runs the `gpu` tests (greedy tokens equal transformers on CUDA for each architecture, bf16 end
# to end, CUDA graphs equal eager steps, the Triton kernels against the torch reference at full
# size), then benchmarks/gpu_bench.py (Qwen3-1.7B shape beside transformers, then `nanoserve serve`
# with 32 streaming clients). Results: gpu-<date>.json and gpu-table.md in $OUT (default
# ./gpu-results); copy them to benchmarks/results/ and the table to benchmarks/RESULTS.md.
# A rehearsal on a CPU machine: WHEELS=<wheels for its Python> GPU_BENCH_ARGS="--preset tiny
# --device cpu" OUT=/tmp/x bash scripts/gpu_check.sh, in a venv holding only what the GPU has.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if python3 -c "import fastapi, uvicorn, sse_starlette, zmq, msgspec" 2>/dev/null; then
  export PYTHONPATH="$PWD"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${WHEELS:-.whl}"/*.whl > "$out/install.log" 2>&1 \
    || { echo "installing the carried wheels failed (see install.log)"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
fi
python3 -c "import nanoserve.server.app, nanoserve.core.engine" \
  || { echo "nanoserve does not import here"; exit 1; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1

started=$SECONDS
timeout 210 python3 -m pytest tests/engine -m gpu -q -p no:cacheprovider > "$out/gpu-tests.log" 2>&1
echo "gpu tests: exit code $?, $((SECONDS - started)) s"
tail -3 "$out/gpu-tests.log"

started=$SECONDS
# shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
timeout 250 python3 -m benchmarks.gpu_bench --out "$out" ${GPU_BENCH_ARGS:-} 2> "$out/gpu-bench.log"
echo "gpu benchmark: exit code $?, $((SECONDS - started)) s"
tail -5 "$out/gpu-bench.log"
