"""What this CPU computes natively, read from the operating system (no torch import).

The front (torch-free) and the worker must agree on what `--dtype auto` means on CPU: the front
sizes KV-cache blocks before the worker starts. Both ask `has_native_bf16`.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# x86: AVX-512 BF16 or AMX-BF16 instructions; Arm: the BF16 extension (`bf16` in Features).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# AMX's bf16 tile products and the AVX-512 BF16 instructions the tile kernels use beside them.
AMX_BF16_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str] | None:
    """The instruction-set flags the OS lists for the first CPU (x86 `flags`, Arm `Features`):
    [] if it lists none, None where there is no such file (not Linux)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return value.split()
    return []


@functools.cache
def has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU has bfloat16 instructions (so bf16 is faster than float32 here)."""
    flags = cpu_flags(cpuinfo)
    if flags is None:  # not Linux: Apple silicon has bf16 from M2 on; assume it elsewhere not
        return platform.system() == "Darwin" and platform.machine() == "arm64"
    return not BF16_FLAGS.isdisjoint(flags)


def has_avx512_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU has AVX-512 BF16's pair dot products (AMD Zen 4 on, Intel Cooper Lake
    and Sapphire Rapids on), which the CPU kernels' prompt attention and decode products (in
    blocks of 64 weight rows) use where it has no AMX."""
    return "avx512_bf16" in (cpu_flags(cpuinfo) or [])


def has_amx_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU has AMX's bf16 tiles (Intel Xeon since Sapphire Rapids), which the CPU
    kernels' prompt attention and decode products use where they were built for them."""
    return set(cpu_flags(cpuinfo) or []) >= AMX_BF16_FLAGS
