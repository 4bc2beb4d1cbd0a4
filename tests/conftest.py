"""Suite-wide pytest setup: `gpu` tests run only where CUDA is present, and the C++ CPU kernels
are built once before any test (servers' workers then load them instead of compiling them
while a test waits for /health)."""

import pytest
import torch

from nanoserve.platforms.cpu.kernels import load_cpu_kernels


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


def pytest_sessionstart(session):
    load_cpu_kernels()  # built by scripts/install.sh (else now, once per install): ~0.01 s
