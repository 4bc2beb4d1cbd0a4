"""Suite-wide pytest setup: `gpu` tests run only where CUDA is present, the C++ CPU kernels
are built once before any test (servers' workers then load them instead of compiling them
while a test waits for /health), and no process a test started outlives the session.

scripts/test.sh runs the suite in one pytest-xdist worker per core (`-n auto`, at most
MAX_WORKERS), each with its own servers: so OpenMP threads here and in the servers the tests
start wait for work passively, instead of spinning at every barrier on a core another worker
needs (benchmarks/RESULTS.md, "The test command"). Nothing a test checks depends on it.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels' tests run them under Triton's interpreter, which must be switched on
    # before anything imports triton (torch.compile does): `triton.language`'s own @triton.jit
    # helpers are wrapped once, at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from leftover_processes import become_subreaper, fail_the_session_for_leftovers

from nanoserve.platforms.cpu.kernels import load_cpu_kernels

MAX_WORKERS = 4  # more would start more servers at once than they gain on a big machine


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_cuda)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core this process may run on, at most MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_sessionstart(session):
    load_cpu_kernels()  # built by scripts/install.sh (else now, once per install): ~0.01 s


def pytest_configure(config):
    become_subreaper()  # so that orphans of killed processes are found at the end too


def pytest_sessionfinish(session, exitstatus):
    fail_the_session_for_leftovers(session)  # a child process still alive fails the run
