"""Building and loading the C++ CPU kernels: keyed by the CPU, switched off by the environment."""

from __future__ import annotations

from nanoserve.platforms.cpu import kernels as cpu_kernels
from nanoserve.platforms.cpu.kernels import (
    STALE_LOCK_S,
    cpu_key,
    load_cpu_kernels,
    remove_stale_build_lock,
)


def test_builds_are_keyed_by_the_cpu_instruction_sets(tmp_path):
    avx2, avx512 = tmp_path / "avx2", tmp_path / "avx512"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    avx512.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_key(avx2) != cpu_key(avx512)
    assert cpu_key(avx2) == cpu_key(avx2) and len(cpu_key(avx2)) == 12
    assert cpu_key(tmp_path / "missing")  # no /proc/cpuinfo: still a key


def test_the_kernels_build_here_and_expose_every_op():
    kernels = load_cpu_kernels()  # the CI image has g++ and ninja
    assert kernels is not None, "the CPU kernels did not build; see the warning in the log"
    assert kernels.__name__ == f"nanoserve_cpu_kernels_{cpu_key()}"
    for op in ("int8_gemv", "bf16_gemv", "bf16_gemv_is_vectorized", "rms_norm", "rotary"):
        assert callable(getattr(kernels, op))


def test_the_environment_switches_them_off(monkeypatch):
    load_cpu_kernels.cache_clear()
    try:
        monkeypatch.setenv("NANOSERVE_CPU_KERNELS", "0")
        assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()
    monkeypatch.delenv("NANOSERVE_CPU_KERNELS")
    assert cpu_kernels.load_cpu_kernels() is not None


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not remove_stale_build_lock(tmp_path)  # no lock
    lock.touch()
    made = lock.stat().st_mtime
    assert not remove_stale_build_lock(tmp_path, now=made + 30)  # a build may be running
    assert lock.exists()
    assert remove_stale_build_lock(tmp_path, now=made + STALE_LOCK_S + 1)
    assert not lock.exists()


def test_the_gemv_prefetch_distance_is_the_fastest_candidate(monkeypatch):
    kernels = load_cpu_kernels()
    assert kernels is not None
    chosen = kernels.gemv_prefetch()
    assert chosen in cpu_kernels.PREFETCH_CANDIDATES  # load_cpu_kernels tuned it already
    monkeypatch.setattr(cpu_kernels, "TUNING_BYTES", 4 << 20)
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


def test_the_timed_prefetch_distance_is_remembered_per_build(monkeypatch, tmp_path):
    kernels = load_cpu_kernels()
    assert kernels is not None
    chosen = kernels.gemv_prefetch()
    timings: list[int] = []

    def timed(module, rounds: int = 3) -> int:
        timings.append(1)
        module.set_gemv_prefetch(4096)
        return 4096

    monkeypatch.setattr(cpu_kernels, "tune_gemv_prefetch", timed)
    try:
        assert cpu_kernels.set_remembered_gemv_prefetch(kernels, tmp_path) == 4096
        kernels.set_gemv_prefetch(0)
        assert cpu_kernels.set_remembered_gemv_prefetch(kernels, tmp_path) == 4096
        assert kernels.gemv_prefetch() == 4096 and timings == [1]  # timed once, then read
        for file in tmp_path.glob("gemv_prefetch-*"):
            file.write_text("512\n")  # not a candidate (an older version's?): timed again
        assert cpu_kernels.set_remembered_gemv_prefetch(kernels, tmp_path) == 4096
        assert timings == [1, 1]
    finally:
        kernels.set_gemv_prefetch(chosen)
