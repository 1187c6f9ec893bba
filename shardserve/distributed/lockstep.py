"""Proof that every rank executes the same step: after running a plan, the ranks compare a summary of
what they ran (step id, chunk and token counts, a digest of the plan) over the control group.

Rank 0 broadcasts each plan, so ranks can only differ through a fault: a corrupted or misread message,
a worker whose own state went astray. Without a check such a rank computes something else and the
first sign is garbage output, or a hang when the collectives stop pairing up. With it, every rank stops
at the first checked step that differs, with the same message naming the step, the ranks and the
fields. The check is one small gloo all-gather; it runs every `every` steps (every step on CPU, where
steps are slow; every 32 on GPUs, where a step can take less time than the collective).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from shardserve import envs
from shardserve.wire.step_plan import StepPlan

EVERY_ENV = envs.LOCKSTEP_EVERY.name
FIELDS = ("step", "chunks", "tokens", "digest")


class LockstepError(RuntimeError):
    """Ranks ran different steps; the server must stop."""


def plan_summary(plan: StepPlan) -> list[int]:
    digest = int.from_bytes(hashlib.blake2b(plan.encode(), digest_size=8).digest(), "little", signed=True)
    return [plan.step_id, len(plan.chunks), plan.num_tokens, digest]


def default_every(device: torch.device) -> int:
    every = envs.LOCKSTEP_EVERY.get()
    if every is not None:
        return max(1, every)
    return 32 if device.type == "cuda" else 1


class LockstepCheck:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, every: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.every = every
        self.checked = 0

    def confirm(self, plan: StepPlan) -> None:
        """Collective over the control group on checked steps: every rank calls it after executing `plan`."""
        if self.world_size == 1 or plan.step_id % self.every:
            return
        mine = torch.tensor(plan_summary(plan), dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        self.checked += 1
        reference = rows[0].tolist()
        differing = {r: row.tolist() for r, row in enumerate(rows) if row.tolist() != reference}
        if differing:
            raise LockstepError(_describe(reference, differing))


def _describe(reference: list[int], differing: dict[int, list[int]]) -> str:
    parts = []
    for rank, row in sorted(differing.items()):
        fields = [f"{name} {theirs} (rank 0: {ours})" if name != "digest" else "plan digest"
                  for name, ours, theirs in zip(FIELDS, reference, row) if ours != theirs]
        parts.append(f"rank {rank} differs in {', '.join(fields)}")
    return (f"ranks out of step at step {reference[0]}: " + "; ".join(parts)
            + ". The server stops rather than compute with ranks that disagree.")
