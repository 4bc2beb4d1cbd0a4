"""The machine a benchmark runs on: its memory read bandwidth, CPUs and load."""

from __future__ import annotations

import os
import platform
import sys
import time


def measure_read_bandwidth_gb_s(threads: int) -> tuple[float, str]:
    """Memory read bandwidth of this machine, median of 5: a float32 sum over 256 MB (2 GB on
    a GPU) of bf16 ones read as float32 (a bf16 sum is bound by its widening on some CPUs: it
    read 17 GB/s where the same bytes as float32 read 26 GB/s and decoding streamed 23)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(threads)
    numel = 1 << 30 if device == "cuda" else 1 << 27  # 2 GB on a GPU, 256 MB on CPU
    x = torch.ones(numel, dtype=torch.bfloat16, device=device)
    timings = []
    for _ in range(6):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.view(torch.float32).sum()
        if device == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    median_s = sorted(timings[1:])[len(timings[1:]) // 2]
    return x.numel() * x.element_size() / median_s / 1e9, device


def describe_machine(threads: int) -> dict:
    """CPUs, platform, measured read bandwidth and the load average before any server starts."""
    bandwidth, bandwidth_device = measure_read_bandwidth_gb_s(threads)
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "read_bandwidth_gb_s": bandwidth,
        "bandwidth_device": bandwidth_device,
        "load_average_at_start": os.getloadavg()[0],
    }


def warn_if_busy(load_average: float) -> None:
    """Other work on the machine skews every number; say so before the run starts."""
    if load_average > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: the 1-minute load average is {load_average:.1f} on {os.cpu_count()} CPUs "
            "before any server starts; other processes will skew these measurements",
            file=sys.stderr,
            flush=True,
        )
