"""Weights stored in fewer bits: int8 weight-only linears (`--quantization int8`) and FP8
checkpoints (block-scaled, as Qwen3-*-FP8 and DeepSeek publish them).

    int8.py   per-output-channel symmetric int8 weights; bf16 activations
    fp8.py    the block-wise FP8 checkpoint format: dequantize at load, or FP8 matmuls on CUDA
"""
