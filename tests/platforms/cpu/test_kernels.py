"""Building and loading the C++ CPU kernels: once per install (in its own folder, keyed by the
CPU and the sources), never waiting on a lock a dead process left, switched off by the
environment. Most tests build a small fake library; the real build is the install's own."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from nanoserve.platforms.cpu import kernels as cpu_kernels
from nanoserve.platforms.cpu.kernels import (
    RECORD,
    build_and_record,
    build_directory,
    cpu_key,
    import_library,
    load_cpu_kernels,
    load_or_build,
)

DEADLINE_S = 60.0  # a lock that is never released, not a slow machine, would pass it

FAKE_LIBRARY = """
prefetch = 0


def set_gemv_prefetch(bytes_ahead):
    global prefetch
    prefetch = bytes_ahead


def gemv_prefetch():
    return prefetch
"""

# Another process that holds a build lock until its stdin gets a line (or it is killed).
HOLD_THE_LOCK = """
import sys
from pathlib import Path
from nanoserve.platforms.cpu.kernels import build_lock
with build_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.readline()
"""


class FakeBuild:
    """Stands in for the compiler: writes a small Python library, counts its builds, and checks
    that it starts in an empty build folder (no torch lock file left by a killed build)."""

    def __init__(self) -> None:
        self.num_builds = 0

    def __call__(self, build_dir: Path) -> ModuleType:
        assert list(build_dir.iterdir()) == [], "a build must start from an empty folder"
        self.num_builds += 1
        library = build_dir / "fake_kernels.py"
        library.write_text(FAKE_LIBRARY)
        return import_library("fake_kernels", library)


@pytest.fixture
def timed_prefetch(monkeypatch) -> list[int]:
    """The prefetch timing replaced by one that picks 4096 and notes each time it runs."""
    timings: list[int] = []

    def tune(module: ModuleType, rounds: int = 3) -> int:
        timings.append(4096)
        module.set_gemv_prefetch(4096)
        return 4096

    monkeypatch.setattr(cpu_kernels, "tune_gemv_prefetch", tune)
    monkeypatch.setattr(cpu_kernels, "tune_gemv_rows", lambda module: 2)
    return timings


def hold_the_lock(directory: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    return holder


def load_in_a_thread(directory: Path, build: FakeBuild) -> tuple[threading.Thread, list]:
    loaded: list[ModuleType] = []
    thread = threading.Thread(target=lambda: loaded.append(load_or_build(directory, build)))
    thread.daemon = True  # a test that fails by hanging must not hang pytest's exit too
    thread.start()
    return thread, loaded


def test_builds_are_keyed_by_the_cpu_instruction_sets(tmp_path):
    avx2, avx512 = tmp_path / "avx2", tmp_path / "avx512"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    avx512.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_key(avx2) != cpu_key(avx512)
    assert cpu_key(avx2) == cpu_key(avx2) and len(cpu_key(avx2)) == 12
    assert cpu_key(tmp_path / "missing")  # no /proc/cpuinfo: still a key


def test_the_kernels_are_the_installs_own_build_and_expose_every_op():
    kernels = load_cpu_kernels()  # built by scripts/install.sh, or by conftest's session start
    assert kernels is not None, "the CPU kernels did not build; see the warning in the log"
    directory = build_directory()
    assert Path(kernels.__file__).is_relative_to(directory)
    if os.access(sys.prefix, os.W_OK):
        assert directory.is_relative_to(Path(sys.prefix) / "lib" / "nanoserve" / "cpu_kernels")
    for op in ("int8_gemv", "bf16_gemv", "bf16_gemv_is_vectorized", "rms_norm", "rotary"):
        assert callable(getattr(kernels, op))
    record = json.loads((directory / RECORD).read_text())
    assert record["gemv_prefetch"] in cpu_kernels.PREFETCH_CANDIDATES  # timed at build
    assert 0 <= record["gemv_max_rows"] <= kernels.bf16_gemv_max_rows()  # timed at build too
    assert kernels.gemv_max_rows == record["gemv_max_rows"]

    def no_build(build_dir: Path) -> ModuleType:
        raise AssertionError("a finished build was compiled again")

    assert load_or_build(directory, no_build).__name__ == kernels.__name__


def test_the_environment_switches_them_off(monkeypatch):
    load_cpu_kernels.cache_clear()
    try:
        monkeypatch.setenv("NANOSERVE_CPU_KERNELS", "0")
        assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()
    monkeypatch.delenv("NANOSERVE_CPU_KERNELS")
    assert cpu_kernels.load_cpu_kernels() is not None


def test_without_a_compiler_they_are_a_warning_and_pytorchs_ops(tmp_path, monkeypatch, caplog):
    def no_compiler(build_dir: Path) -> ModuleType:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_kernels, "build_directory", lambda: tmp_path / "kernels")
    monkeypatch.setattr(cpu_kernels, "compile_kernels", no_compiler)
    load_cpu_kernels.cache_clear()
    try:
        assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()  # the next test gets this install's real build
    assert "CPU kernels not built (Ninja is required" in caplog.text
    assert "using PyTorch's ops" in caplog.text


def test_a_second_load_imports_the_build_without_building_or_timing_again(tmp_path, timed_prefetch):
    build = FakeBuild()
    first = load_or_build(tmp_path / "kernels", build)
    first.set_gemv_prefetch(0)
    second = load_or_build(tmp_path / "kernels", build)
    assert build.num_builds == 1 and timed_prefetch == [4096]
    assert second.gemv_prefetch() == 4096  # the distance timed at build, from the record


def test_two_install_prefixes_do_not_share_a_build(tmp_path, timed_prefetch):
    (tmp_path / "venv-one").mkdir()
    (tmp_path / "venv-two").mkdir()
    one, other = build_directory(tmp_path / "venv-one"), build_directory(tmp_path / "venv-two")
    assert one.is_relative_to(tmp_path / "venv-one") and other.is_relative_to(tmp_path / "venv-two")
    assert one.name == other.name  # same CPU, same sources: only the install differs
    build = FakeBuild()
    for directory in (one, other, one, other):
        assert Path(str(load_or_build(directory, build).__file__)).is_relative_to(directory)
    assert build.num_builds == 2


def test_a_read_only_prefix_builds_in_a_user_cache_keyed_by_the_prefix(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels.os, "access", lambda path, mode: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    one, other = build_directory(Path("/usr")), build_directory(Path("/usr/local"))
    assert one.is_relative_to(tmp_path / "cache" / "nanoserve" / "cpu_kernels")
    assert one != other and one.name == other.name


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_one(tmp_path, timed_prefetch):
    directory = tmp_path / "kernels"
    holder = hold_the_lock(directory)
    (directory / "build").mkdir()
    (directory / "build" / "lock").touch()  # torch's own lock file, which nothing removes
    (directory / "build" / "gemv.o").write_bytes(b"half an object")
    holder.send_signal(signal.SIGKILL)  # killed midway through "its build"
    holder.wait()
    build = FakeBuild()  # it fails if the killed build's files are still there
    thread, loaded = load_in_a_thread(directory, build)
    thread.join(DEADLINE_S)
    assert loaded and build.num_builds == 1
    assert not (directory / "build" / "gemv.o").exists()


def test_a_build_in_progress_is_waited_for_and_the_log_says_so(tmp_path, timed_prefetch, caplog):
    caplog.set_level(logging.INFO, logger="nanoserve.cpu_kernels")
    directory = tmp_path / "kernels"
    holder = hold_the_lock(directory)
    build = FakeBuild()
    thread, loaded = load_in_a_thread(directory, build)
    deadline = time.monotonic() + DEADLINE_S
    while f"waiting for pid {holder.pid}" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.02)
    assert f"waiting for pid {holder.pid}, building the CPU kernels in {directory}" in caplog.text
    assert thread.is_alive() and not loaded
    build_and_record(directory, build)  # the build the holder was running finishes
    assert holder.stdin is not None
    holder.stdin.write("done\n")
    holder.stdin.close()
    assert holder.wait(DEADLINE_S) == 0
    thread.join(DEADLINE_S)
    assert loaded and build.num_builds == 1  # the waiter loaded that build, did not make its own
    assert "waited" in caplog.text


def test_a_new_build_removes_this_installs_older_builds_for_this_cpu(tmp_path, timed_prefetch):
    builds = tmp_path / "cpu_kernels"
    older, building, other_cpu = builds / "cpu1-old", builds / "cpu1-busy", builds / "cpu2-old"
    for directory in (older, building, other_cpu):
        directory.mkdir(parents=True)
    with open(building / "build.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # someone is building this one right now
        load_or_build(builds / "cpu1-new", FakeBuild())
    assert sorted(path.name for path in builds.iterdir()) == ["cpu1-busy", "cpu1-new", "cpu2-old"]


def test_a_build_that_does_not_load_is_built_again(tmp_path, timed_prefetch):
    build = FakeBuild()
    load_or_build(tmp_path / "kernels", build)
    (tmp_path / "kernels" / "build" / "fake_kernels.py").unlink()
    assert load_or_build(tmp_path / "kernels", build).gemv_prefetch() == 4096
    assert build.num_builds == 2


def test_the_gemv_prefetch_distance_is_the_fastest_candidate(monkeypatch):
    kernels = load_cpu_kernels()
    assert kernels is not None
    chosen = kernels.gemv_prefetch()
    assert chosen in cpu_kernels.PREFETCH_CANDIDATES  # timed at build, set at load
    monkeypatch.setattr(cpu_kernels, "past_the_caches", lambda: 4 << 20)
    real = cpu_kernels.stream_seconds
    try:
        for fastest in cpu_kernels.PREFETCH_CANDIDATES:
            timed: list[int] = []

            def timing(module, weights, fastest=fastest, timed=timed):
                real(module, weights)  # the kernels run with the distance being tried
                timed.append(module.gemv_prefetch())
                return 1.0 if timed[-1] == fastest else 2.0

            monkeypatch.setattr(cpu_kernels, "stream_seconds", timing)
            assert cpu_kernels.tune_gemv_prefetch(kernels, rounds=2) == fastest
            assert kernels.gemv_prefetch() == fastest
            assert sorted(timed) == sorted(2 * list(cpu_kernels.PREFETCH_CANDIDATES))
    finally:
        kernels.set_gemv_prefetch(chosen)


def test_the_gemv_is_timed_at_every_size_to_16_then_every_8th():
    assert cpu_kernels.gemv_row_sizes(16) == list(range(1, 17))
    assert cpu_kernels.gemv_row_sizes(80) == [*range(1, 17), 24, 32, 40, 48, 56, 64, 72, 80]
    assert cpu_kernels.gemv_row_sizes(4) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("by_the_margin_up_to", "faster_up_to", "expected", "slower_at"),
    [
        (0, 3, 0, []),  # 5% faster at one token: not worth a second copy of the weights
        (1, 5, 5, []),  # worth it at one token, then it takes every size where it is faster
        (3, 3, 3, []),
        (1, 30, 24, []),  # faster at 24 tokens, slower at 32: 24 (and 17-23 with it)
        (1, 80, 64, [72, 80]),  # slower at the last two sizes
        (1, 80, 80, [48]),  # slower once, at 48 (noise): the range goes on past it
        (80, 80, 80, []),
    ],
)
def test_the_gemv_takes_the_sizes_where_it_beats_onednn(
    monkeypatch, by_the_margin_up_to, faster_up_to, expected, slower_at
):
    kernels = load_cpu_kernels()
    assert kernels is not None
    tuned = kernels.gemv_max_rows
    monkeypatch.setattr(cpu_kernels, "past_the_caches", lambda: 4 << 20)
    monkeypatch.setattr(kernels, "bf16_gemv_max_rows", lambda: 80)  # as on AMX's tiles
    real = cpu_kernels.time_products
    seen: list[tuple[str, int]] = []

    def timing(module, how, num_rows, weights, packed):
        real(module, how, num_rows, weights, packed)  # both products run on the weights
        seen.append((how, num_rows))
        if how == "packed":
            return 1.0
        if num_rows in slower_at:
            return 1.05
        if num_rows <= by_the_margin_up_to:
            return 0.85  # 15% faster
        return 0.95 if num_rows <= faster_up_to else 1.05  # 5% faster, then 5% slower

    monkeypatch.setattr(cpu_kernels, "time_products", timing)
    try:
        assert cpu_kernels.tune_gemv_rows(kernels, rounds=1) == expected
        assert kernels.gemv_max_rows == expected
        sizes = cpu_kernels.gemv_row_sizes(80)
        # To the second loss in a row (at one token, to the first: the margin decides there).
        timed = sizes[: sizes.index(expected) + 3] if expected else [1]
        assert sorted(seen) == sorted((how, n) for how in ("gemv", "packed") for n in timed)
    finally:
        kernels.gemv_max_rows = tuned


def test_the_last_level_cache_is_read_from_sysfs():
    assert cpu_kernels.last_level_cache_bytes() >= 0
    assert cpu_kernels.TUNING_BYTES <= cpu_kernels.past_the_caches() <= 1 << 30


def test_the_prefetch_is_timed_on_layer_shaped_weights_past_the_caches(monkeypatch):
    kernels = load_cpu_kernels()
    assert kernels is not None
    monkeypatch.setattr(cpu_kernels, "past_the_caches", lambda: 64 << 20)
    weights = cpu_kernels.tuning_weights(kernels)
    layer_bytes = 2 * sum(n * k for n, k in cpu_kernels.TUNING_LAYER)
    assert len(weights) == len(cpu_kernels.TUNING_LAYER) * ((64 << 20) // layer_bytes)
    for ((n, k), int8, bf16), shape in zip(weights, cpu_kernels.tuning_shapes(), strict=True):
        assert (n, k) == shape
        # each as the model's layers hold it: in its GEMV's layout
        blocks = kernels.int8_gemv_blocks(torch.ones(n, k, dtype=torch.int8))
        assert int8.dtype == torch.int8 and int8.numel() == n * k
        assert int8.shape == (blocks.shape if blocks is not None else (n // 2, 2 * k))
        plain = torch.ones(n, k, dtype=torch.bfloat16)
        assert bf16.dtype == torch.bfloat16 and bf16.shape == kernels.bf16_gemv_weight(plain).shape
        assert bf16.numel() == n * k
    bf16_bytes = sum(2 * bf16.numel() for _, _, bf16 in weights)
    assert (64 << 20) - layer_bytes < bf16_bytes <= 64 << 20


def test_a_change_to_the_build_time_timing_asks_for_a_new_build(monkeypatch):
    before = cpu_kernels.build_key()
    monkeypatch.setattr(cpu_kernels, "TUNING_VERSION", cpu_kernels.TUNING_VERSION + 1)
    assert cpu_kernels.build_key() != before
