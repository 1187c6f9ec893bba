"""A rank of a simulated tensor-parallel group for layer tests without a process group."""

from __future__ import annotations

import torch


class PartialSums:
    """A rank of a simulated group: all_reduce leaves this rank's share as it is; the test sums the shares."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x
