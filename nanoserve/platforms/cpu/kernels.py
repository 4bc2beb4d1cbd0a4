"""nanoserve's C++ kernels for CPU (`platforms/cpu/csrc/*.cpp`), built once per install.

    int8_gemv               int8 weight-only products of decode steps (quantization/int8.py)
    bf16_gemv               bf16 products of a few tokens (linear.py), from the weight as
                            bf16_gemv_weight lays it out: in blocks of 64 rows on AVX-512 BF16
                            (block_gemv.cpp), in AMX's tiles where the CPU has them
                            (amx_gemv.cpp: up to 80 tokens a pass)
    paged_decode_attention  decode steps' attention, read in place from the paged KV cache
                            (attention.py)
    rms_norm                RMSNorm in one pass per row (fused_ops.py)
    rotary                  the rotary embedding in one pass per head (fused_ops.py)
    silu_mul                SwiGLU's silu(gate) * up in one pass per row (fused_ops.py)
    store_kv                a step's keys and values into their cache slots (attention.py)
    add_rms_norm            a residual add and the RMSNorm after it, in one pass per row
    qk_norm_rotary          a step's q/k heads normed (Qwen3) and rotated, in one pass per head
    moe_group, moe_combine  an MoE step's (token, expert) pairs grouped by expert, and the
                            experts' outputs summed back per token (moe/cpu.py)
    row_argmax, draw_rows   the sampler's passes over whole rows: each row's argmax, and a
                            token drawn by inverse transform (sampler_ops.py)
    DecodeLayers            a decode step through every decoder layer in one call, with the
                            kernels above (fused_decode.py), experts included
    SuffixTrie,             suffix decoding's tries (spec_decode/suffix.py's, the same drafts)
    GrowingSuffixTrie       without Python's cost a node (suffix_tries.py)

PyTorch's own ops are correct but, for a decode step's short rows, cost their dispatch rather
than their arithmetic (and PyTorch's int8 kernel converts more slowly than memory delivers).

`scripts/install.sh` builds them (`python -m nanoserve.platforms.cpu.kernels`): torch's
extension builder compiles the sources with the host's C++ compiler for this CPU
(`-march=native`, about a minute), then the GEMVs' prefetch distance is timed, and up to how
many tokens the bf16 GEMV beats oneDNN's packed product (`gemv_max_rows`, an attribute of the
loaded module). The result lives
in the install's own folder (`build_directory`: under `sys.prefix`, named after this CPU's
instruction sets and a hash of what the library is built from), so two virtual environments
never share, rebuild or lock each other's build, and every start imports it in a fraction of a
second. Where nothing was built yet (a plain `pip install`), the first start builds it there.

    <prefix>/lib/nanoserve/cpu_kernels/<cpu key>-<build key>/
        build.lock    an fcntl.flock held by the one process building (it holds that pid)
        build/        torch's build folder: ninja file, objects, the library
        built.json    written last, when the build is complete: the library, the prefetch distance

The flock dies with its holder, so a build killed midway blocks no later start (torch's own
`lock` file would, forever), and the next build starts again from an empty build/. Without a
compiler (or ninja), or with `NANOSERVE_CPU_KERNELS=0`, nothing is built and every caller keeps
PyTorch's ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from nanoserve.common.cpu_features import cpu_flags
from nanoserve.quantization.int8 import Int8LinearMethod

logger = logging.getLogger("nanoserve.cpu_kernels")

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = (
    "amx_gemv.cpp",
    "bindings.cpp",
    "block_gemv.cpp",
    "decode_attention.cpp",
    "decode_layers.cpp",
    "fused_ops.cpp",
    "gemv.cpp",
    "moe_pairs.cpp",
    "prompt_attention.cpp",
    "sampling.cpp",
    "suffix_trie.cpp",
)
MODULE_NAME = "nanoserve_cpu_kernels"
# -ffp-contract=off: no a * b + c becomes one rounding, so fused_ops round as PyTorch does.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
RECORD = "built.json"
# The GEMVs' prefetch distances timed at build (bytes ahead; 0: the hardware prefetcher alone),
# each streaming TUNING_LAYER's weights in int8 and bf16, past the caches.
PREFETCH_CANDIDATES = (0, 2048, 4096, 8192)
TUNING_BYTES = 128 << 20  # the least weight bytes a timing streams (past_the_caches)
# Raised when what is timed at build changes, so that every install times its build again.
TUNING_VERSION = 7
# Up to how many tokens bf16_gemv streams a weight once is the library's to say
# (`bf16_gemv_max_rows()`: 80 on AMX's tiles, 16 elsewhere in two passes of 8). The build times
# every size up to 16, then every 8th (`gemv_row_sizes`), until the GEMV loses twice in a row.
GEMV_ROW_STEP = 8  # past 16 tokens, the sizes timed
LOSSES_TO_STOP = 2  # timed sizes in a row at which oneDNN wins that end the GEMV's range
# One decoder layer's weights ([out, in]: qkv, o, gate_up, down of the Qwen3-0.6B shape), the
# products the GEMV and oneDNN are timed on.
TUNING_LAYER = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
GEMV_MARGIN = 0.10  # how much faster the GEMV must be to be worth a second copy of the weights

Build = Callable[[Path], ModuleType]


def cpu_key(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """A short name for this CPU's instruction sets: `-march=native` builds are only reused on
    a CPU with the same ones (a virtual environment may live on a disk shared by machines)."""
    flags = " ".join(cpu_flags(cpuinfo) or [])
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def build_key() -> str:
    """A hash of all the library is built from besides the CPU: the sources and headers, the
    flags, torch's and Python's versions. A change to any of them needs a new build."""
    digest = hashlib.sha256()
    for source in sorted([*SOURCE_DIR.glob("*.cpp"), *SOURCE_DIR.glob("*.h")]):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    versions = [torch.__version__, sys.version, f"tuning {TUNING_VERSION}"]
    digest.update(" ".join([*CFLAGS, *LDFLAGS, *versions]).encode())
    return digest.hexdigest()[:12]


def build_directory(prefix: Path | None = None) -> Path:
    """Where the install at `prefix` (default: this one, `sys.prefix`) keeps its build for this
    CPU; where the prefix is read-only (a system Python), a per-user cache keyed by the prefix."""
    prefix = Path(sys.prefix) if prefix is None else prefix
    name = f"{cpu_key()}-{build_key()}"
    if os.access(prefix, os.W_OK):
        return prefix / "lib" / "nanoserve" / "cpu_kernels" / name
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    install = hashlib.sha256(str(prefix.resolve()).encode()).hexdigest()[:12]
    return cache_home / "nanoserve" / "cpu_kernels" / install / name


def kernels_enabled() -> bool:
    """False when NANOSERVE_CPU_KERNELS=0 asks for PyTorch's ops only."""
    return os.environ.get("NANOSERVE_CPU_KERNELS", "1") != "0"


@cache
def load_cpu_kernels() -> ModuleType | None:
    """This install's compiled kernels (built now, once, if scripts/install.sh did not), or None
    where they can't be built or NANOSERVE_CPU_KERNELS=0 asks for PyTorch's ops."""
    if not kernels_enabled():
        return None
    started = time.perf_counter()
    try:
        directory = build_directory()
        module = load_or_build(directory)
    except Exception as error:  # no compiler, no ninja, a compile error, a read-only disk
        logger.warning("CPU kernels not built (%s); using PyTorch's ops", error)
        return None
    logger.info("CPU kernels loaded in %.2f s from %s", time.perf_counter() - started, directory)
    return module


def load_or_build(directory: Path, build: Build | None = None) -> ModuleType:
    """The library built in `directory`; built there first (by `build`, default
    `compile_kernels`) if no build finished there yet, by this process or one it waits for."""
    module = load_built(directory)
    if module is not None:
        return module
    with build_lock(directory):
        module = load_built(directory)  # another process may have built it while we waited
        if module is None:
            module = build_and_record(directory, build or compile_kernels)
    return module


def load_built(directory: Path) -> ModuleType | None:
    """The library of the finished build in `directory`, its prefetch distance set as timed at
    build; None where no build finished (or what it left does not load: it is built again)."""
    record_path = directory / RECORD
    if not record_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text())
        module = import_library(record["module"], directory / record["library"])
        module.set_gemv_prefetch(record["gemv_prefetch"])
        module.gemv_max_rows = int(record["gemv_max_rows"])  # type: ignore[attr-defined]
    except (OSError, ImportError, ValueError, KeyError, AttributeError) as error:
        logger.warning("the CPU kernels built in %s do not load (%s)", directory, error)
        return None
    return module


def import_library(module_name: str, path: Path) -> ModuleType:
    """Import the built library at `path` (as torch's `load` does after building)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an importable library")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold `directory`/build.lock while building. It is an `fcntl.flock`: the kernel releases it
    when its holder exits or is killed, so no one ever waits on a lock a dead process left."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            logger.info("waiting for %s, building the CPU kernels in %s", holder, directory)
            started = time.perf_counter()
            fcntl.flock(lock, fcntl.LOCK_EX)
            logger.info("waited %.1f s for that build", time.perf_counter() - started)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}\n")  # for the message above, in a process that waits
        lock.flush()
        yield


def build_and_record(directory: Path, build: Build) -> ModuleType:
    """Build into an empty `directory`/build (a killed build's leftovers, torch's lock file among
    them, are thrown away), time the GEMVs' prefetch distance, then write the record that tells
    every later start the build is complete. The caller holds the build lock."""
    (directory / RECORD).unlink(missing_ok=True)
    shutil.rmtree(directory / "build", ignore_errors=True)
    (directory / "build").mkdir()
    logger.info("building CPU kernels (once per install) in %s…", directory)
    started = time.perf_counter()
    module = build(directory / "build")
    build_s = time.perf_counter() - started
    record = {
        "module": module.__name__,
        "library": str(Path(str(module.__file__)).relative_to(directory)),
        "gemv_prefetch": tune_gemv_prefetch(module),
        "gemv_max_rows": tune_gemv_rows(module),
        "build_s": round(build_s, 1),
    }
    unfinished = directory / f"{RECORD}.tmp"
    unfinished.write_text(json.dumps(record, indent=1) + "\n")
    unfinished.replace(directory / RECORD)  # atomic: a reader sees no record or all of it
    logger.info("CPU kernels built in %.1f s", build_s)
    remove_older_builds(directory)
    return module


def compile_kernels(build_dir: Path) -> ModuleType:
    """Compile csrc/*.cpp into `build_dir` with torch's extension builder (ninja and the host's
    C++ compiler); the library it imports."""
    from torch.utils.cpp_extension import load

    module = load(
        name=MODULE_NAME,
        sources=[str(SOURCE_DIR / source) for source in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
    )
    assert isinstance(module, ModuleType)  # is_python_module=True: a module, not a path
    return module


def remove_older_builds(directory: Path) -> None:
    """Delete this install's builds for this CPU from other sources (an edited kernel, an older
    torch), skipping any that a live process is building."""
    cpu_part = directory.name.split("-")[0]
    for other in directory.parent.glob(f"{cpu_part}-*"):
        if other == directory or not other.is_dir():
            continue
        with open(other / "build.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built right now
            shutil.rmtree(other, ignore_errors=True)


# A tuning weight: (N, K), the int8 GEMV's copy and the bf16 GEMV's copy, each in its layout.
TuningWeight = tuple[tuple[int, int], torch.Tensor, torch.Tensor]


def stream_seconds(module: ModuleType, weights: list[TuningWeight]) -> float:
    """Seconds for the int8 and bf16 GEMVs to stream `weights` once, one row."""
    inputs = {k: torch.ones(1, k, dtype=torch.bfloat16) for (_, k), _, _ in weights}
    scales = {n: torch.ones(n) for (n, _), _, _ in weights}
    started = time.perf_counter()
    for (n, k), int8, bf16 in weights:
        module.int8_gemv(inputs[k], int8, scales[n])
        module.bf16_gemv(inputs[k], bf16)
    return time.perf_counter() - started


def tuning_shapes() -> list[tuple[int, int]]:
    """TUNING_LAYER's shapes, repeated until their bf16 weights stream past the caches: many
    layer-sized matrices, as a model's decode step streams them (one matrix as large as all of
    them favoured another prefetch distance than the model's own step did)."""
    copies = max(1, past_the_caches() // (2 * sum(n * k for n, k in TUNING_LAYER)))
    return TUNING_LAYER * copies


def tuning_weights(module: ModuleType) -> list[TuningWeight]:
    """`tuning_shapes`' weights in int8 and bf16, each as its GEMV reads it here (int8: as
    `Int8LinearMethod` lays it out; bf16: `bf16_gemv_weight`)."""
    int8_method = Int8LinearMethod(module.int8_gemv, module.int8_gemv_blocks)
    weights = []
    for n, k in tuning_shapes():
        int8 = int8_method.gemv_layout(torch.ones(n, k, dtype=torch.int8))
        assert int8 is not None, "TUNING_LAYER's widths are whole 32-weight chunks"
        bf16 = module.bf16_gemv_weight(torch.ones(n, k, dtype=torch.bfloat16))
        weights.append(((n, k), int8, bf16))
    return weights


def tune_gemv_prefetch(module: ModuleType, rounds: int = 3) -> int:
    """Set the GEMVs' prefetch distance to the fastest of PREFETCH_CANDIDATES on this CPU (the
    best one differs between CPUs), timed on weights larger than the caches; returns it."""
    weights = tuning_weights(module)
    best: dict[int, float] = {}
    for _ in range(rounds):  # candidates alternate, so that a noisy machine shifts them all
        for bytes_ahead in PREFETCH_CANDIDATES:
            module.set_gemv_prefetch(bytes_ahead)
            seconds = stream_seconds(module, weights)
            best[bytes_ahead] = min(best.get(bytes_ahead, seconds), seconds)
    chosen = min(best, key=best.__getitem__)
    module.set_gemv_prefetch(chosen)
    timings = ", ".join(f"{b}: {s * 1e3:.1f} ms" for b, s in best.items())
    logger.info("GEMV prefetch: %d bytes ahead (%s)", chosen, timings)
    return chosen


def gemv_row_sizes(most_rows: int) -> list[int]:
    """The token counts the build times the GEMV at: each up to 16, then every GEMV_ROW_STEP
    up to `most_rows` (a size between two timed ones goes as the larger one went)."""
    each_to_16 = range(1, min(16, most_rows) + 1)
    return [*each_to_16, *range(16 + GEMV_ROW_STEP, most_rows + 1, GEMV_ROW_STEP)]


def tune_gemv_rows(module: ModuleType, rounds: int = 3) -> int:
    """The most tokens (up to `bf16_gemv_max_rows()`) for which the bf16 GEMV multiplies by a
    layer's weights; 0 unless it is at least GEMV_MARGIN faster than oneDNN's packed product at
    one token (then no linear keeps its plain weight beside the packed one). Where it is, it
    takes each further size (`gemv_row_sizes`) up to the last where it is faster, and stops
    timing once it loses at LOSSES_TO_STOP sizes in a row (one slow timing on a noisy machine
    does not end it; the plain copy is kept either way). Timed on TUNING_LAYER's shapes, repeated
    past the last-level cache (a model's weights do not fit in it: what comes from memory is
    what counts); where oneDNN cannot pack bf16, `bf16_gemv_max_rows()`. Sets and returns it."""
    most_rows = int(module.bf16_gemv_max_rows())
    weights = [torch.ones(n, k, dtype=torch.bfloat16) for n, k in tuning_shapes()]
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    except (RuntimeError, AttributeError):  # no bf16 packing here (AVX2 only)
        module.gemv_max_rows = most_rows  # type: ignore[attr-defined]
        return most_rows
    weights = [module.bf16_gemv_weight(w) for w in weights]  # as the GEMV reads them
    chosen, losses, timings = 0, 0, []
    for num_rows in gemv_row_sizes(most_rows):
        best = {"gemv": math.inf, "packed": math.inf}
        for _ in range(rounds):  # the two alternate, so that a noisy machine shifts both
            for how in best:
                best[how] = min(best[how], time_products(module, how, num_rows, weights, packed))
        timings.append(f"{num_rows}: {best['gemv'] * 1e3:.1f}/{best['packed'] * 1e3:.1f} ms")
        margin = GEMV_MARGIN if num_rows == 1 else 0.0
        if best["gemv"] < (1 - margin) * best["packed"]:
            chosen, losses = num_rows, 0
        elif num_rows == 1 or (losses := losses + 1) == LOSSES_TO_STOP:
            break  # not worth a second copy at one token; or plainly slower from here on
    logger.info(
        "products of up to %d tokens by the GEMV (GEMV/oneDNN: %s)", chosen, ", ".join(timings)
    )
    module.gemv_max_rows = chosen  # type: ignore[attr-defined]
    return chosen


def past_the_caches() -> int:
    """Bytes of weights that stream from memory, not the last-level cache: twice its size (as
    this machine reports it), at least TUNING_BYTES, at most 1 GiB."""
    return min(max(TUNING_BYTES, 2 * last_level_cache_bytes()), 1 << 30)


def last_level_cache_bytes() -> int:
    """The largest cache Linux lists for CPU 0 (sysfs sizes read "32K", "480M"); 0 if none."""
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (index / "size").read_text().strip()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes)


def time_products(
    module: ModuleType,
    how: str,
    num_rows: int,
    weights: list[torch.Tensor],
    packed: list[torch.Tensor],
) -> float:
    """Seconds to multiply `num_rows` tokens by every weight, by the GEMV (`weights`, in its
    layout) or the packed one."""
    inputs = {p.shape[1]: torch.ones(num_rows, p.shape[1], dtype=torch.bfloat16) for p in packed}
    started = time.perf_counter()
    for weight, packed_weight in zip(weights, packed, strict=True):
        x = inputs[packed_weight.shape[1]]
        if how == "gemv":
            module.bf16_gemv(x, weight)
        else:
            torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")
    return time.perf_counter() - started


def main() -> int:
    """`python -m nanoserve.platforms.cpu.kernels`, run by scripts/install.sh: build this
    install's kernels now, so that no start has to. Exits 0 where they can't be built (the
    warning says why): the server then runs on PyTorch's ops."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not kernels_enabled():
        print("NANOSERVE_CPU_KERNELS=0: the CPU kernels are not built")
        return 0
    if load_cpu_kernels() is not None:
        print(f"CPU kernels ready in {build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
