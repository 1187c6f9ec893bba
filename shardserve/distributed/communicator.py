"""The tensor-parallel data plane: the few collectives the model needs, behind one small interface.

Every rank of a group must call the same collectives in the same order; the engine guarantees that
by having all ranks execute the same step plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Communicator:
    """All-reduce and gathers of activations over one tensor-parallel group."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate each rank's x along the last dimension, in rank order, on the group's first rank only."""
        if self.world_size == 1:
            return x
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = Communicator(None, 0, 1)
