"""TensorParallel: which shard of every parallel layer this process holds, and its collectives.

The layers shard themselves by it (`layers/linear.py`); with the default, rank 0 of 1, they are
the plain layers and every collective is a no-op. It is passed to the model when it is built
(no global state); joining a real group of N processes is `nanoserve.distributed`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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
            raise ValueError(
                f"{what} ({total}) is not divisible by the tensor-parallel size ({self.size})"
            )
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
        dist.gather(x, parts, dst=self.first_global_rank, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    @property
    def first_global_rank(self) -> int:
        """Rank 0 of the group, as torch.distributed's global rank."""
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)
