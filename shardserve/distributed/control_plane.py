"""Step plans from rank 0 to the other ranks, over the gloo control group.

Each message is a header [message number, payload bytes] followed by the msgpack payload. Message
numbers run 1, 2, 3... on every rank; a receiver that sees another number than the one it expects
stops with an error naming both, instead of running a step out of order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardserve.distributed.lockstep import LockstepError
from shardserve.engine.step_plan import StepPlan

__all__ = ["ControlPlane", "LockstepError"]


class ControlPlane:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.message_no = 0

    def send(self, plan: StepPlan) -> None:
        if self.world_size == 1:
            return
        payload = plan.encode()
        self.message_no += 1
        header = torch.tensor([self.message_no, len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=self.src, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=self.src, group=self.group)

    def receive(self) -> StepPlan:
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=self.src, group=self.group)
        message_no, size = int(header[0]), int(header[1])
        self.message_no += 1
        if message_no != self.message_no:
            raise LockstepError(f"rank {self.rank} expected step message {self.message_no} from rank 0 "
                                f"but received message {message_no}: the ranks are out of step")
        payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=self.src, group=self.group)
        return StepPlan.decode(payload.numpy().tobytes())
