"""The ranks of one engine, rank side: where a worker process sits in its tensor-parallel group,
how it builds its shard of the engine, and what the ranks other than 0 do.

Rank 0 is the worker the front talks to (ZMQ): it schedules, samples and broadcasts each step.
The other ranks only execute (`follow`). All of them join one torch.distributed group through a
rendezvous address (`tcp://host:port`) that the front chose (`client/worker_process.py`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from nanoserve.common.config import EngineConfig

logger = logging.getLogger("nanoserve.worker")


@dataclass(frozen=True)
class RankPlacement:
    """Where one worker process sits in the engine's tensor-parallel group."""

    rank: int = 0
    init_method: str | None = None  # None: a group of one


def make_engine(config: EngineConfig, placement: RankPlacement):
    """Join the group (if any) and build this rank's engine: its shard of the model."""
    import torch

    from nanoserve.core.loader import resolve_device
    from nanoserve.distributed.parallel import init_tensor_parallel
    from nanoserve.engine_setup import build_engine

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
    return build_engine(config, tp)


def run_follower(config: EngineConfig, placement: RankPlacement, parent_pid: int) -> int:
    """Body of a rank other than 0: execute the steps rank 0 broadcasts, until it stops."""
    try:
        from nanoserve.engine_setup import follow_rank_zero

        engine = make_engine(config, placement)
        follow_rank_zero(engine)
        return 0
    except Exception:
        if os.getppid() != parent_pid:
            return 0  # the group was torn down around us
        logger.exception("rank %d failed", placement.rank)
        return 1
