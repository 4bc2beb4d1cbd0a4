"""Joining a tensor-parallel group: one process per rank, NCCL on CUDA, gloo on CPU.

The group's view (`TensorParallel`: rank, size, collectives) is the core's
(`nanoserve/core/parallel.py`); the layers shard themselves by it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from nanoserve.core.parallel import TensorParallel

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a dead peer fails the group, never a hang


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device
) -> TensorParallel:
    """Join the group (`init_method`: `tcp://host:port` or `file://path`) and return its view."""
    if size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD)
