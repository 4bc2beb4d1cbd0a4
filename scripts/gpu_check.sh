#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (see the device tool), in under 8 minutes, with no
# network there. That machine has Python 3.12 with torch, triton, transformers, tokenizers,
# safetensors, huggingface_hub, httpx, prometheus-client, jinja2, numpy and pytest; the rest of
# nanoserve's needs travel as wheels:
#
#   here, once:  echo /.whl/ >> .git/info/exclude && bash ../shared/tools/gpu_wheels.sh .whl
#   there:       bash scripts/gpu_check.sh          (carry .whl; results land in $OUT)
#
# It runs the `gpu` tests (greedy tokens equal transformers on CUDA for each architecture, bf16 end
# to end, CUDA graphs equal eager steps, the Triton kernels against the torch reference at full
# size, FP8, MoE), then benchmarks/gpu_bench.py (Qwen3-1.7B shape beside transformers, then
# `nanoserve serve` with 32 streaming clients, then the MoE row: Qwen3-30B-A3B, dummy bf16).
# Results: gpu-<date>.json and gpu-table.md in $OUT
# (default ./gpu-results); copy them to benchmarks/results/ and the table to benchmarks/RESULTS.md.
# Exits non-zero when the tests or the benchmark fail, or outlast GPU_TESTS_TIMEOUT_S (default 210)
# or GPU_BENCH_TIMEOUT_S (default 320) seconds.
#
# CI rehearses it on CPU after the tests (scripts/gpu_check_rehearsal.sh: a virtual environment
# holding only what the GPU machine has, WHEELS=<wheels for its Python>, GPU_BENCH_ARGS="--preset
# tiny --device cpu"), so that it still runs the day a GPU is lent.
set -uo pipefail # no -e: each stage runs and reports, even after one that failed
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=$(mktemp -d) # the carried wheels, installed for this run only
trap 'rm -rf "$site"' EXIT

if python3 -c "import fastapi, uvicorn, sse_starlette, zmq, msgspec" 2>/dev/null; then
  export PYTHONPATH="$PWD"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${WHEELS:-.whl}"/*.whl > "$out/install.log" 2>&1 \
    || { echo "installing the carried wheels failed (see install.log)"; exit 1; }
  export PYTHONPATH="$site:$PWD"
fi
python3 -c "import nanoserve.server.app, nanoserve.core.engine" \
  || { echo "nanoserve does not import here"; exit 1; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1

# Every test file that holds `gpu` tests, found so that a new one is never left out. The CPU
# kernels are off: these tests don't use them, and a compiler there would spend a minute.
mapfile -t gpu_test_files < <(grep -rlE --include='test_*.py' 'mark\.gpu\b' tests | sort)
started=$SECONDS
NANOSERVE_CPU_KERNELS=0 timeout "${GPU_TESTS_TIMEOUT_S:-210}" python3 -m pytest "${gpu_test_files[@]}" -m gpu -q \
  -p no:cacheprovider > "$out/gpu-tests.log" 2>&1
tests_status=$?
echo "gpu tests: exit code $tests_status, $((SECONDS - started)) s"
tail -3 "$out/gpu-tests.log"

started=$SECONDS
# shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
timeout "${GPU_BENCH_TIMEOUT_S:-320}" python3 -m benchmarks.gpu_bench --out "$out" ${GPU_BENCH_ARGS:-} \
  2> "$out/gpu-bench.log"
bench_status=$?
echo "gpu benchmark: exit code $bench_status, $((SECONDS - started)) s"
tail -5 "$out/gpu-bench.log"
if [ "$bench_status" -ne 0 ] && [ -f "$out/gpu-serve.log" ]; then
  tail -5 "$out/gpu-serve.log" # the server's last words, if it was the stage that failed
fi

[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
