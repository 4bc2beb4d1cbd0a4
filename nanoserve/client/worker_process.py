"""The front's handle on worker processes: start one per tensor-parallel rank of this machine,
with the environment they compute in, watch them, stop them.

Every rank of one engine joins one torch.distributed group through a rendezvous address
(`tcp://host:port`: a free local port, or `--master-addr:--master-port` when the group spans
machines) that the front chooses here and passes on the worker's command line. `WorkerGroup` is
the front's (or a headless node's) handle on the ranks of this machine; any rank that exits
brings the group down. The worker's side is `nanoserve/worker/`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import msgspec

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import DEFAULT_HEARTBEAT_INTERVAL_S, WorkerAddresses

logger = logging.getLogger("nanoserve.server")

WORKER_MODULE = "nanoserve.worker.main"  # what `python -m` runs in every worker process
WORKER_KERNEL_CACHE_SIZE = 128  # compiled oneDNN primitives kept per cache (CPU)
# Up to this many cores the worker computes on all of them: leaving one to the front would cost
# 1/cores of the compute, and on 2 cores that measured worse at every load (RESULTS.md).
ALL_CORES_UP_TO = 4
# glibc keeps the memory the worker frees: blocks up to 32 MiB (the most glibc allows) come from
# its heap, and the heap is not trimmed back to the OS until 1 GiB lies free at its top.
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def worker_environment(num_local_ranks: int = 1) -> dict[str, str]:
    """The worker's environment: the front's, with compute threads chosen for this machine.

    - Threads: unless OMP_NUM_THREADS says otherwise the worker computes on every core of a
      small machine (up to ALL_CORES_UP_TO), where a core left idle for the front costs more
      than the front's few milliseconds per step, and on `cores - 1` of a larger one, so the
      front and its HTTP clients keep a core. Ranks of one engine share them.
    - OpenMP keeps its default wait policy (spin briefly between parallel regions, then sleep):
      passive waiting pays a thread wake-up on every op.
    - PyTorch's CPU allocator keeps its default 4 KB pages: THP_MEM_ALLOC_ENABLE is left to the
      user. Huge pages under every tensor of 2 MB and more made decoding 1-8% faster on some
      machines (fewer TLB misses while weights stream), but on a virtual machine whose host
      backs memory on first touch they cost 3-4 s of every start (the weights and their packed
      copies faulted in 2 MB at a time) and gained nothing measurable.
    - glibc keeps what the worker frees (GLIBC_TUNABLES=KEEP_FREED_MEMORY unless set). With
      PyTorch's huge-page blocks (THP_MEM_ALLOC_ENABLE=1), glibc's defaults handed freed memory
      back to the OS, so every prefill faulted its activations in afresh (~11,000 page faults,
      each zeroed by the kernel, for a 1,500-token prompt of the 0.6B shape); now the next
      prefill reuses the same memory. The worker's memory stays at its high-water mark, which
      the largest step bounds.
    - oneDNN's caches of compiled matmul primitives hold WORKER_KERNEL_CACHE_SIZE entries each
      (LRU_CACHE_CAPACITY: PyTorch's ideep op cache; ONEDNN_PRIMITIVE_CACHE_CAPACITY), not their
      default 1,024: every new token count of a step compiles a primitive, and a long mixed load
      kept growing the worker's memory until the caches were full.

    What each choice measured is in benchmarks/RESULTS.md.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(worker_threads(os.cpu_count() or 1, num_local_ranks)))
    env.setdefault("GLIBC_TUNABLES", KEEP_FREED_MEMORY)
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        env.setdefault(name, str(WORKER_KERNEL_CACHE_SIZE))
    return env


def worker_threads(num_cores: int, num_local_ranks: int = 1) -> int:
    """Compute threads per rank: every core of a small machine, all but one of a larger one."""
    reserved_for_front = 0 if num_cores <= ALL_CORES_UP_TO else 1
    return max(1, (num_cores - reserved_for_front) // num_local_ranks)


def local_ranks(config: EngineConfig) -> range:
    """The global ranks this machine runs: node k holds the k-th block of tp / nnodes ranks."""
    per_node = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def rendezvous_address(config: EngineConfig) -> str | None:
    """The group's rendezvous: the master's address and port, or a free port on this machine."""
    if config.tensor_parallel_size == 1:
        return None
    if config.master_port is not None:  # data-parallel engine k meets on the k-th port after
        return f"tcp://{config.master_addr}:{config.master_port + config.data_parallel_rank}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def worker_command(
    config: EngineConfig,
    addresses: WorkerAddresses,
    log_level: str,
    rank: int,
    init_method: str | None,
    heartbeat_interval_s: float,
) -> list[str]:
    """The command line of one worker process (`nanoserve/worker/main.py` parses it)."""
    flags = {
        "--to-worker": addresses.to_worker,
        "--to-front": addresses.to_front,
        "--parent-pid": str(os.getpid()),
        "--log-level": log_level,
        "--heartbeat-interval": str(heartbeat_interval_s),
        "--config": msgspec.json.encode(config).decode(),
        "--rank": str(rank),
        "--dist-init": init_method or "",
    }
    return [sys.executable, "-m", WORKER_MODULE, *(s for pair in flags.items() for s in pair)]


class WorkerProcess:
    """The front's handle on one worker process (one rank of one engine)."""

    def __init__(
        self,
        config: EngineConfig,
        addresses: WorkerAddresses,
        log_level: str = "info",
        rank: int = 0,
        init_method: str | None = None,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    ) -> None:
        command = worker_command(
            config, addresses, log_level, rank, init_method, heartbeat_interval_s
        )
        # Every rank of every data-parallel engine on this machine shares its cores.
        num_processes = len(local_ranks(config)) * config.data_parallel_size
        env = worker_environment(num_local_ranks=num_processes)
        self._popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait up to `timeout_s` for the worker to exit (after Shutdown), then kill it."""
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("worker %d did not exit in %.1f s; killing it", self.pid, timeout_s)
            self._popen.kill()
            self._popen.wait()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()
        self._popen.wait()


class WorkerGroup:
    """The processes of one engine on this machine; alive only while every one of them is."""

    def __init__(self, processes: list[WorkerProcess]) -> None:
        self.processes = processes  # rank order
        self.pid = processes[0].pid

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    @property
    def returncode(self) -> int | None:
        dead = [p.returncode for p in self.processes if not p.is_alive()]
        return dead[0] if dead else None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait for every rank to exit (rank 0 stops the others), then kill what is left."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.stop(max(0.1, deadline - time.monotonic()))

    def kill(self) -> None:
        for process in self.processes:
            process.kill()


def start_worker_group(
    config: EngineConfig,
    addresses: WorkerAddresses,
    log_level: str = "info",
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
) -> WorkerGroup:
    """Start this machine's ranks of one engine (rank 0 among them talks to the front)."""
    init_method = rendezvous_address(config)
    return WorkerGroup(
        [
            WorkerProcess(config, addresses, log_level, rank, init_method, heartbeat_interval_s)
            for rank in local_ranks(config)
        ]
    )
