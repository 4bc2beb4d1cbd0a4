"""The CUDA fast paths: Triton attention kernels and CUDA graphs for decode steps."""
