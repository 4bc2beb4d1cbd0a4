"""Reading the CPU's bf16 support from /proc/cpuinfo (what `--dtype auto` depends on)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from nanoserve.common.cpu_features import has_amx_bf16, has_avx512_bf16, has_native_bf16


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile", True),  # Sapphire Rapids
        ("flags\t\t: fpu sse avx2 amx_bf16", True),
        ("flags\t\t: fpu sse avx2 avx512f avx512bw", False),  # Skylake: bf16 only emulated
        ("Features\t: fp asimd bf16 i8mm", True),  # Arm with the BF16 extension
        ("Features\t: fp asimd", False),
    ],
)
def test_bf16_is_read_from_the_cpu_flags(tmp_path: Path, line: str, expected: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\n{line}\n")
    assert has_native_bf16(cpuinfo) is expected


def test_a_missing_cpuinfo_is_not_an_error(tmp_path: Path) -> None:
    apple_silicon = platform.system() == "Darwin" and platform.machine() == "arm64"
    assert has_native_bf16(tmp_path / "absent") is apple_silicon


def test_amx_needs_the_tiles_their_bf16_products_and_avx512_bf16(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    assert has_amx_bf16(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu avx512f avx512_bf16 amx_tile\n")  # no bf16 tiles
    assert not has_amx_bf16(cpuinfo)
    assert not has_amx_bf16(tmp_path / "absent")  # not Linux


def test_avx512_bf16_is_its_own_flag_not_any_bf16(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")  # AMD Zen 4/5
    assert has_avx512_bf16(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_vnni\n")  # Ice Lake: no bf16
    assert not has_avx512_bf16(cpuinfo)
    cpuinfo.write_text("Features\t: fp asimd bf16\n")  # Arm's bf16 is another instruction set
    assert not has_avx512_bf16(cpuinfo)
    assert not has_avx512_bf16(tmp_path / "absent")
