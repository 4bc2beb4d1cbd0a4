"""nanoserve's C++ kernels for CPU (`platforms/cpu/csrc/*.cpp`), compiled on first use on a machine.

    int8_gemv               int8 weight-only products of decode steps (quantization/int8.py)
    bf16_gemv               bf16 products of decode steps, from the plain weight (cpu_linear.py)
    paged_decode_attention  decode steps' attention, read in place from the paged KV cache
                            (attention/cpu_kernel.py)
    rms_norm                RMSNorm in one pass per row (layers/cpu_fused.py)
    rotary                  the rotary embedding in one pass per head (layers/cpu_fused.py)
    silu_mul                SwiGLU's silu(gate) * up in one pass per row (layers/cpu_fused.py)

PyTorch's own ops are correct but, for a decode step's short rows, cost their dispatch rather
than their arithmetic (and PyTorch's int8 kernel converts more slowly than memory delivers).
The sources are compiled by `torch.utils.cpp_extension` with the host's C++ compiler, for this
CPU (`-march=native`): about half a minute the first time a worker starts on a machine, then
loaded from torch's extension cache (~/.cache/torch_extensions) in well under a second. The
build's name carries a key of the CPU's instruction sets, so a home directory shared with
another kind of CPU gets its own build. Without a compiler (or ninja), or with
`NANOSERVE_CPU_KERNELS=0`, nothing is compiled and every caller keeps PyTorch's ops.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.common.cpu_features import cpu_flags

logger = logging.getLogger("nanoserve.cpu_kernels")

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "decode_attention.cpp", "fused_ops.cpp", "gemv.cpp")
# -ffp-contract=off: no a * b + c becomes one rounding, so fused_ops round as PyTorch does.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
# A build takes about a minute. A lock file much older than that was left by a build that was
# killed (say, Ctrl-C during a first start), and torch would wait for it to go away forever.
STALE_LOCK_S = 600.0
# The GEMVs' prefetch distances tried at load (bytes ahead; 0: the hardware prefetcher alone),
# each timed streaming int8 and bf16 matrices of TUNING_BYTES (more than most CPUs' L3).
PREFETCH_CANDIDATES = (0, 4096)
TUNING_BYTES = 128 << 20
TUNING_ROW = 1024


def cpu_key(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """A short name for this CPU's instruction sets: `-march=native` builds are only reused on
    a CPU with the same ones (a home directory may be shared between machines)."""
    flags = " ".join(cpu_flags(cpuinfo) or [])
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def headers_key() -> str:
    """A hash of csrc's headers: torch rebuilds when a source or a flag changes, not a header,
    so the build's flags carry this."""
    digest = hashlib.sha256()
    for header in sorted(SOURCE_DIR.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:12]


def kernels_enabled() -> bool:
    """False when NANOSERVE_CPU_KERNELS=0 asks for PyTorch's ops only."""
    return os.environ.get("NANOSERVE_CPU_KERNELS", "1") != "0"


def remove_stale_build_lock(build_dir: Path, now: float | None = None) -> bool:
    """Delete `build_dir`/lock if it is older than STALE_LOCK_S; True if it was."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False  # another process may be building right now
    logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


@cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module (built on first use, then cached on disk), or None if it can't be."""
    if not kernels_enabled():
        return None
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"nanoserve_cpu_kernels_{cpu_key()}"
        build_dir = Path(_get_build_directory(name, verbose=False))
        remove_stale_build_lock(build_dir)
        module = load(
            name=name,
            sources=[str(SOURCE_DIR / name) for name in SOURCES],
            extra_cflags=[*CFLAGS, f"-DNANOSERVE_HEADERS={headers_key()}"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # no compiler, no ninja, a compile error: PyTorch's ops
        logger.warning("CPU kernels not built (%s); using PyTorch's ops", error)
        return None
    set_remembered_gemv_prefetch(module, build_dir)
    logger.info("CPU kernels ready in %.1f s", time.perf_counter() - started)
    return module


def set_remembered_gemv_prefetch(module: ModuleType, build_dir: Path) -> int:
    """The GEMVs' prefetch distance as timed by the first start of this build on this CPU
    (the build is per CPU; the file is per version of gemv.cpp), or timed now and written
    down: a start then skips the 256 MiB and ~0.15 s of `tune_gemv_prefetch`."""
    source_key = hashlib.sha256((SOURCE_DIR / "gemv.cpp").read_bytes()).hexdigest()[:12]
    remembered = build_dir / f"gemv_prefetch-{source_key}"
    try:
        bytes_ahead = int(remembered.read_text())
        if bytes_ahead in PREFETCH_CANDIDATES:
            module.set_gemv_prefetch(bytes_ahead)
            return bytes_ahead
    except (OSError, ValueError):
        pass  # not timed yet (or unreadable): time it
    bytes_ahead = tune_gemv_prefetch(module)
    with contextlib.suppress(OSError):  # a read-only cache: timed again at the next start
        remembered.write_text(f"{bytes_ahead}\n")
    return bytes_ahead


def stream_seconds(module: ModuleType, weights: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Seconds for the int8 and bf16 GEMVs to stream `weights` once, one row: int8 in row
    pairs ([N/2, 2K], as quantization/int8.py stores it) and bf16 [N, K]."""
    int8, bf16 = weights
    x = torch.ones(1, bf16.shape[1], dtype=torch.bfloat16)
    scales = torch.ones(2 * int8.shape[0])
    started = time.perf_counter()
    module.int8_gemv(x, int8, scales)
    module.bf16_gemv(x, bf16)
    return time.perf_counter() - started


def tune_gemv_prefetch(module: ModuleType, rounds: int = 3) -> int:
    """Set the GEMVs' prefetch distance to the faster of PREFETCH_CANDIDATES on this CPU (the
    best one differs between CPUs), timed on matrices larger than the caches; returns it."""
    rows = TUNING_BYTES // TUNING_ROW
    weights = (torch.ones(rows // 2, 2 * TUNING_ROW, dtype=torch.int8),
               torch.ones(rows // 2, TUNING_ROW, dtype=torch.bfloat16))  # fmt: skip
    best: dict[int, float] = {}
    for _ in range(rounds):  # candidates alternate, so that a noisy machine shifts them all
        for bytes_ahead in PREFETCH_CANDIDATES:
            module.set_gemv_prefetch(bytes_ahead)
            seconds = stream_seconds(module, weights)
            best[bytes_ahead] = min(best.get(bytes_ahead, seconds), seconds)
    chosen = min(best, key=best.__getitem__)
    module.set_gemv_prefetch(chosen)
    logger.info("GEMV prefetch: %d bytes ahead (%s)", chosen,
                ", ".join(f"{b}: {s * 1e3:.1f} ms" for b, s in best.items()))  # fmt: skip
    return chosen
