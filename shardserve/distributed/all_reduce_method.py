"""What every all-reduce method offers (NCCL or gloo, peer memory, shared memory on CPUs), apart from
distributed/all_reduce.py's choice among them, so a method in its own module need not import the chooser."""

from __future__ import annotations

import torch


class AllReduceMethod:
    name: str = ""

    def supports(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group; returns the result (x itself, reduced in place, or a new tensor)."""
        raise NotImplementedError
