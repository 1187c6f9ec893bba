"""Control data between ranks, in msgpack (never pickle).

Step plans go from rank 0 to the other ranks (block tables as their changes: wire/step_plan.py's PlanEncoder
and PlanDecoder, whose state the lockstep digest of the whole plan checks). Each message is a header [message number, payload bytes]
followed by the msgpack payload and its MAC under the launch's control key (distributed/control_token.py),
which covers the message number too. Message numbers run 1, 2, 3... on every rank. A receiver that sees
another number than the one it expects, a MAC that does not match, or a payload that is not a plan logs
why and stops, instead of running a step it cannot trust. The messages travel over a TCP connection from rank 0
to each rank where every rank could make one (distributed/plan_stream.py), else as two broadcasts over the gloo
control group; the checks are the same either way.

`all_gather_msgpack` is the replacement for torch's `all_gather_object` (which unpickles what other
ranks send) for the few start-up exchanges of plain data.
"""

from __future__ import annotations

import hmac
import logging
import struct
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import torch.distributed as dist

from shardserve.distributed.control_token import MAC_BYTES, mac
from shardserve.distributed.lockstep import LockstepError
from shardserve.wire.step_plan import PlanDecoder, PlanEncoder, StepPlan

if TYPE_CHECKING:
    from shardserve.distributed.plan_stream import PlanStreams
    from shardserve.distributed.process_group import RankContext

__all__ = ["ControlPlane", "ControlMessageRefused", "LockstepError", "all_gather_msgpack"]

logger = logging.getLogger(__name__)

# A plan holds at most a step's tokens and block tables; a header announcing more is not from rank 0.
MAX_PLAN_BYTES = 256 * 2**20
HEADER = struct.Struct("<qq")  # message number, payload bytes (the gloo path sends them as an int64 tensor)


class ControlMessageRefused(LockstepError):
    """A control message this rank did not expect or could not authenticate; the rank stops."""


class ControlPlane:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, key: bytes | None = None,
                 streams: PlanStreams | None = None) -> None:
        """`streams`: the TCP connections plans travel on (plan_stream.py); None: gloo broadcasts over `group`."""
        if world_size > 1 and key is None:
            raise ValueError("a control plane between several ranks needs the launch's control key")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.key = key
        self.streams = streams
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.message_no = 0
        self._encoder = PlanEncoder()  # rank 0
        self._decoder = PlanDecoder()  # the other ranks

    @classmethod
    def connect(cls, ctx: RankContext) -> ControlPlane:
        """The rank's control plane, over TCP connections to rank 0 where every rank makes one. A collective
        step: every rank of `ctx` calls it at the same point of its start-up."""
        from shardserve.distributed.plan_stream import open_plan_streams
        from shardserve.distributed.process_group import collective_timeout
        from shardserve.distributed.setup_watchdog import setup_step

        streams = None
        if ctx.world_size > 1:
            with setup_step("connect the step-plan streams", ctx.rank):
                streams = open_plan_streams(ctx.control_group, ctx.rank, ctx.world_size, ctx.control_key,
                                            ctx.rendezvous_host, collective_timeout().total_seconds(),
                                            ctx.describe_rank)
        return cls(ctx.control_group, ctx.rank, ctx.world_size, ctx.control_key, streams)

    @property
    def transport(self) -> str:
        return "tcp" if self.streams is not None else "gloo"

    def close(self) -> None:
        if self.streams is not None:
            self.streams.close()

    def send(self, plan: StepPlan) -> None:
        if self.world_size == 1:
            return
        payload = self._encoder.encode(plan)
        self.message_no += 1
        signed = payload + mac(self.key, self.message_no, payload)
        if self.streams is not None:
            self.streams.send(HEADER.pack(self.message_no, len(payload)) + signed)
            return
        header = torch.tensor([self.message_no, len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=self.src, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(signed), dtype=torch.uint8), src=self.src, group=self.group)

    def receive(self) -> StepPlan:
        message_no, size = self._receive_header()
        self.message_no += 1
        if message_no != self.message_no:
            self._refuse(f"expected step message {self.message_no} from rank 0 but received message {message_no}: "
                         f"the ranks are out of step")
        if not 0 <= size <= MAX_PLAN_BYTES:
            self._refuse(f"step message {message_no} announces {size} bytes, which no plan has")
        data = self._receive_signed(size + MAC_BYTES)
        payload, tag = data[:size], data[size:]
        if not hmac.compare_digest(tag, mac(self.key, message_no, payload)):
            self._refuse(f"step message {message_no} does not carry rank 0's signature (wrong control token, or "
                         f"someone else on the control connection)")
        try:
            return self._decoder.decode(payload)
        except Exception as exc:  # noqa: BLE001 - any decoding failure means the same: not a plan
            self._refuse(f"step message {message_no} is not a step plan ({type(exc).__name__}: {exc})")

    def _receive_header(self) -> tuple[int, int]:
        if self.streams is not None:
            return HEADER.unpack(self.streams.receive(HEADER.size))
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=self.src, group=self.group)
        return int(header[0]), int(header[1])

    def _receive_signed(self, size: int) -> bytes:
        if self.streams is not None:
            return bytes(self.streams.receive(size))
        signed = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(signed, src=self.src, group=self.group)
        return signed.numpy().tobytes()

    def _refuse(self, why: str) -> None:
        message = f"rank {self.rank} refuses a control message: {why}; this rank stops"
        logger.error(message)
        raise ControlMessageRefused(message)


def all_gather_msgpack(value: Any, group: dist.ProcessGroup | None, world_size: int) -> list[Any]:
    """Every rank's `value` (plain data: dicts, lists, strings, numbers), in rank order, on every rank.

    A collective over `group` (gloo: CPU tensors): sizes first, then the payloads padded to the longest.
    Tuples come back as lists.
    """
    payload = msgpack.packb(value)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine, group=group)
    return [msgpack.unpackb(part[:int(n)].numpy().tobytes()) for part, n in zip(parts, sizes)]
