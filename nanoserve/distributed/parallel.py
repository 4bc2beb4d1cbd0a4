"""TensorParallel: which shard of every parallel layer this process holds, and its collectives.

A tensor-parallel group of N processes ("ranks") splits each layer's weights N ways: q/k/v and
gate/up by output rows (column-parallel: each rank computes its own heads and its own slice of
the MLP), o_proj and down_proj by input columns (row-parallel: each rank's partial sums are
all-reduced), the embedding and LM head by vocabulary rows. NCCL carries the collectives on
CUDA, gloo on CPU. The object is passed to the model when it is built: no global state.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a dead peer fails the group, never a hang


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (rank 0 of 1 when there is none)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def split(self, total: int, what: str) -> int:
        """`total` divided among the ranks; an error names `what` when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                             f"({self.size})")  # fmt: skip
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the sum)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dim; the others get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=self._global_rank(0), group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank gets rank 0's `x` (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=self._global_rank(0), group=self.group)
        return x

    def _global_rank(self, group_rank: int) -> int:
        return (
            dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank
        )


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
