"""The CPU's fast paths: C++ kernels (csrc/), packed linears, fused ops, the CPU attention
backend and the compiled decode step."""
