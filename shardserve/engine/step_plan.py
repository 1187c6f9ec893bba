"""The step plan: what every rank computes in one engine step, decided by rank 0.

It is encoded with msgpack (never pickle) so a rank only ever decodes plain numbers and lists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack


class PlanKind(enum.IntEnum):
    RUN = 0  # run the model on `chunks`
    KEEPALIVE = 1  # nothing to run; proves rank 0 is alive
    SHUTDOWN = 2  # leave the worker loop
    SLEEP = 3  # release device memory; arg: the level (1 keeps the weights in host memory, 2 drops them)
    WAKE = 4  # take device memory back; arg: WAKE_WEIGHTS | WAKE_KV_CACHE
    RELOAD = 5  # load the weights afresh from the checkpoint


WAKE_WEIGHTS, WAKE_KV_CACHE = 1, 2
FROM_DEVICE = -1  # a token id not yet on the host: the step takes it from the previous step's sampled tokens


@dataclass
class SeqChunk:
    """Tokens of one sequence to compute this step, at positions start_position, start_position + 1, ..."""

    seq_id: int
    start_position: int
    token_ids: list[int]
    block_table: list[int]
    sample: bool  # whether this chunk ends at the sequence's last token, so logits are needed


@dataclass
class StepPlan:
    step_id: int
    kind: PlanKind
    chunks: list[SeqChunk] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)
    arg: int = 0  # SLEEP and WAKE: see PlanKind
    # RUN: the first num_device_tokens chunks are one FROM_DEVICE token each, whose ids the step takes from
    # the previous step's sampled tokens (rank 0 gathers them in chunk order); the other chunks carry ids
    tokens_from_device: bool = False

    def encode(self) -> bytes:
        chunks = [[c.seq_id, c.start_position, c.token_ids, c.block_table, c.sample] for c in self.chunks]
        return msgpack.packb([self.step_id, int(self.kind), chunks, self.freed_seq_ids, self.arg,
                              self.tokens_from_device])

    @classmethod
    def decode(cls, data: bytes) -> "StepPlan":
        step_id, kind, chunks, freed, arg, from_device = msgpack.unpackb(data)
        return cls(step_id, PlanKind(kind), [SeqChunk(*c) for c in chunks], freed, arg, from_device)

    @property
    def num_device_tokens(self) -> int:
        if not self.tokens_from_device:
            return 0
        return next((i for i, c in enumerate(self.chunks) if c.token_ids != [FROM_DEVICE]), len(self.chunks))

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
