"""What the front starts worker processes with: their compute threads and environment, the
ranks of this machine and the group's rendezvous, and the command line the worker parses."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from nanoserve.client.worker_process import (
    KEEP_FREED_MEMORY,
    WORKER_KERNEL_CACHE_SIZE,
    local_ranks,
    rendezvous_address,
    worker_command,
    worker_environment,
    worker_threads,
)
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import WorkerAddresses
from nanoserve.worker.main import main as worker_main


@pytest.mark.parametrize(
    ("cores", "ranks", "threads"),
    [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 7), (16, 1, 15), (2, 2, 1), (8, 2, 3), (3, 4, 1)],
)
def test_small_machines_compute_on_every_core(cores, ranks, threads):
    assert worker_threads(cores, ranks) == threads


def test_worker_environment_leaves_a_core_and_keeps_openmp_waiting(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    env = worker_environment()
    assert env["OMP_NUM_THREADS"] == "7" and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert worker_environment()["OMP_NUM_THREADS"] == "3"


def test_worker_environment_leaves_huge_pages_to_the_user(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert "THP_MEM_ALLOC_ENABLE" not in worker_environment()  # PyTorch's default: off
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert worker_environment()["THP_MEM_ALLOC_ENABLE"] == "1"


def test_worker_environment_keeps_freed_memory_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert worker_environment()["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert worker_environment()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


# Two activations of a prefill (16 and 24 MiB) filled and freed twelve times: the page faults
# of the last six rounds.
REFAULTS = """
import resource, torch
def step():
    torch.empty(1 << 23, dtype=torch.bfloat16).fill_(1)
    torch.empty(3 << 22, dtype=torch.bfloat16).fill_(1)
for _ in range(6):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def refaults(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", REFAULTS], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="GLIBC_TUNABLES is glibc's")
def test_the_worker_reuses_freed_memory_instead_of_faulting_it_in_again(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert refaults(worker_environment()) < 20  # the default: 4 KB pages
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # a user's choice of huge pages
    env = worker_environment()
    assert refaults(env) < 20  # the heap's memory, mapped in the first rounds
    # glibc's defaults hand the huge-page blocks back and map them anew every round (at least a
    # fault per 2 MiB page)
    assert refaults({**env, "GLIBC_TUNABLES": ""}) >= 6 * 20


def test_worker_environment_bounds_the_onednn_caches_unless_told_otherwise(monkeypatch):
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
        assert worker_environment()[name] == str(WORKER_KERNEL_CACHE_SIZE)
        monkeypatch.setenv(name, "7")
        assert worker_environment()[name] == "7"


def test_ranks_are_split_node_by_node():
    config = EngineConfig(model="m", tensor_parallel_size=4, nnodes=2, node_rank=1, master_port=5)
    assert list(local_ranks(config)) == [2, 3]
    assert rendezvous_address(config) == "tcp://127.0.0.1:5"
    assert rendezvous_address(EngineConfig(model="m")) is None
    with pytest.raises(ValueError, match="must be a multiple of nnodes"):
        EngineConfig(model="m", tensor_parallel_size=3, nnodes=2, master_port=5)
    with pytest.raises(ValueError, match="needs master_port"):
        EngineConfig(model="m", tensor_parallel_size=2, nnodes=2)


def test_data_parallel_engines_meet_on_ports_of_their_own_and_stay_on_one_machine():
    config = EngineConfig(
        model="m",
        tensor_parallel_size=2,
        data_parallel_size=2,
        data_parallel_rank=1,
        master_port=7000,
    )
    assert rendezvous_address(config) == "tcp://127.0.0.1:7001"
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        EngineConfig(model="m", data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="nnodes must be 1"):
        EngineConfig(
            model="m", tensor_parallel_size=2, nnodes=2, master_port=5, data_parallel_size=2
        )


def test_the_worker_parses_the_command_the_front_builds(monkeypatch):
    """Every flag the front passes is one the worker's parser takes, with its value."""
    config = EngineConfig(model="m", tensor_parallel_size=2, master_port=7000)
    addresses = WorkerAddresses("ipc:///x/to_worker", "ipc:///x/to_front")
    command = worker_command(config, addresses, "warning", 1, "tcp://127.0.0.1:7000", 0.25)
    assert command[1:3] == ["-m", "nanoserve.worker.main"]
    seen = {}

    def follower(config, placement, parent_pid):
        seen.update(config=config, placement=placement, parent_pid=parent_pid)
        return 7

    monkeypatch.setattr("nanoserve.worker.main.run_follower", follower)
    assert worker_main(command[3:]) == 7  # rank 1 follows
    assert seen["config"] == config
    assert (seen["placement"].rank, seen["placement"].init_method) == (1, "tcp://127.0.0.1:7000")
