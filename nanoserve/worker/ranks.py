"""The worker processes of one engine: one per tensor-parallel rank on this machine.

Rank 0 is the worker the front talks to (ZMQ): it schedules, samples and broadcasts each step.
The other ranks only execute (`follow`). All of them join one torch.distributed group through a
rendezvous address (`tcp://host:port`: a free local port, or `--master-addr:--master-port` when
the group spans machines). `WorkerGroup` is the front's (or a headless node's) handle on the
ranks of this machine; any rank that exits brings the group down.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

from nanoserve.common.config import EngineConfig

logger = logging.getLogger("nanoserve.worker")


@dataclass(frozen=True)
class RankPlacement:
    """Where one worker process sits in the engine's tensor-parallel group."""

    rank: int = 0
    init_method: str | None = None  # None: a group of one


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


def make_engine(config: EngineConfig, placement: RankPlacement):
    """Join the group (if any) and build this rank's engine: its shard of the model."""
    import torch

    from nanoserve.core.engine import Engine
    from nanoserve.core.loader import resolve_device
    from nanoserve.distributed.parallel import init_tensor_parallel

    device = resolve_device(config.device)
    if (
        device.type == "cuda"
        and device.index is None
        and (config.tensor_parallel_size > 1 or config.data_parallel_size > 1)
    ):
        # One GPU per local rank; data-parallel engine k takes the k-th block of them.
        per_node = config.tensor_parallel_size // config.nnodes
        torch.cuda.set_device(config.data_parallel_rank * per_node + placement.rank % per_node)
    tp = init_tensor_parallel(
        placement.rank, config.tensor_parallel_size, placement.init_method or "", device
    )
    return Engine(config, tp)


def run_follower(config: EngineConfig, placement: RankPlacement, parent_pid: int) -> int:
    """Body of a rank other than 0: execute the steps rank 0 broadcasts, until it stops."""
    try:
        engine = make_engine(config, placement)
        engine.runner.follow()
        return 0
    except Exception:
        if os.getppid() != parent_pid:
            return 0  # the group was torn down around us
        logger.exception("rank %d failed", placement.rank)
        return 1


class WorkerGroup:
    """The processes of one engine on this machine; alive only while every one of them is."""

    def __init__(self, processes: list) -> None:
        self.processes = processes  # WorkerProcess handles, rank order
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
