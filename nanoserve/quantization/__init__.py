"""Weights and the KV cache stored in fewer bits: int8 weight-only linears (`--quantization
int8`), FP8 checkpoints (block-scaled, as Qwen3-*-FP8 and DeepSeek publish them) and the FP8 KV
cache.

    int8.py   per-output-channel symmetric int8 weights; bf16 activations
    fp8.py    the block-wise FP8 checkpoint format: dequantize at load, or FP8 matmuls on CUDA
    kv_cache_fp8.py   the FP8 KV cache (`--kv-cache-dtype fp8`): quantize on write, per-layer
                      K and V scales (checkpoint, measured, or 1.0) folded into attention
"""
