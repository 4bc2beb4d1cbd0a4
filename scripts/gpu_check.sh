#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (see the device tool): GPU tests, then the GPU
# decode benchmark, results under $OUT (default ./gpu-results). Copy the numbers into
# benchmarks/RESULTS.md with the date and the machine.
#   bash scripts/gpu_check.sh
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
python -c "import torch" 2>/dev/null || pip install -q torch
pip install -q -e '.[dev]' > "$out/install.log" 2>&1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -m pytest tests -m gpu -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log" | tail -5
python -m benchmarks.gpu_decode --model Qwen/Qwen3-1.7B --output "$out/gpu-decode-eager.md" 2>&1 \
  | tail -8
python -m benchmarks.gpu_decode --model Qwen/Qwen3-1.7B --compile \
  --output "$out/gpu-decode-compiled.md" 2>&1 | tail -8
