"""What the CPU platform's tests share: the compiled kernels."""

from types import ModuleType

import pytest

from nanoserve.platforms.cpu.kernels import load_cpu_kernels


@pytest.fixture(scope="session")
def kernels() -> ModuleType:
    """The install's CPU kernels, built on first use (the CI image has g++ and ninja)."""
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build; see the warning in the log"
    return kernels
