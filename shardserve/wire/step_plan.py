"""The step plan: what every rank computes in one engine step, decided by rank 0.

It is encoded with msgpack (never pickle) so a rank only ever decodes plain numbers and lists. `encode` writes
a plan whole (the lockstep digest covers that form); between ranks the plans go through a PlanEncoder and
PlanDecoder pair, which send each block table as its change since the step before.
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
    # The sequence's slot in the recurrent-state pools (models with linear-attention layers), -1 without. A
    # chunk at start_position 0 starts the sequence: every rank zeroes its slot before the step.
    state_slot: int = -1
    # Proposed tokens at the chunk's end (speculative decoding): logits are kept for its last draft + 1 rows, whose
    # argmaxes verify them (engine/speculative.py). 0: only the last row's, where `sample`.
    draft: int = 0


@dataclass
class StepPlan:
    step_id: int
    kind: PlanKind
    chunks: list[SeqChunk] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)  # sequences that finished since the last plan
    arg: int = 0  # SLEEP and WAKE: see PlanKind
    # RUN: the first num_device_tokens chunks are one FROM_DEVICE token each, whose ids the step takes from
    # the previous step's sampled tokens (rank 0 gathers them in chunk order); the other chunks carry ids
    tokens_from_device: bool = False

    def encode(self) -> bytes:
        chunks = [[c.seq_id, c.start_position, c.token_ids, c.block_table, c.sample, c.state_slot, c.draft]
                  for c in self.chunks]
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


class PlanEncoder:
    """Rank 0's side of the plans sent to the other ranks, with block tables as changes.

    A running sequence's block table only grows, so a chunk names how many blocks of the table the other
    ranks already have for its sequence (`keep`) and adds the new ones: at batch 512 with 48-block tables a
    decode step's message shrinks from about 80 KB to a few. A table that changed otherwise (a preempted
    sequence starts again with other blocks) goes whole (keep 0). Each side forgets a sequence's table when a
    plan lists it in freed_seq_ids.

    Invariant: after each plan, `known` here equals `known` of every PlanDecoder that decoded the same plans.
    """

    def __init__(self) -> None:
        self.known: dict[int, list[int]] = {}

    def encode(self, plan: StepPlan) -> bytes:
        for seq_id in plan.freed_seq_ids:
            self.known.pop(seq_id, None)
        chunks = []
        for c in plan.chunks:
            table, known = c.block_table, self.known.get(c.seq_id)
            keep = len(known) if known is not None and table[:len(known)] == known else 0
            chunks.append([c.seq_id, c.start_position, c.token_ids, keep, table[keep:], c.sample, c.state_slot,
                           c.draft])
            self.known[c.seq_id] = list(table)
        return msgpack.packb([plan.step_id, int(plan.kind), chunks, plan.freed_seq_ids, plan.arg,
                              plan.tokens_from_device])


class PlanDecoder:
    """The other ranks' side: rebuilds each chunk's whole block table from the blocks kept and those added."""

    def __init__(self) -> None:
        self.known: dict[int, list[int]] = {}

    def decode(self, data: bytes) -> StepPlan:
        step_id, kind, encoded, freed, arg, from_device = msgpack.unpackb(data)
        for seq_id in freed:
            self.known.pop(seq_id, None)
        chunks = []
        for seq_id, start, token_ids, keep, added, sample, state_slot, draft in encoded:
            known = self.known.get(seq_id, [])
            if not 0 <= keep <= len(known):
                raise ValueError(f"the plan keeps {keep} blocks of sequence {seq_id}, this rank has {len(known)}")
            table = known[:keep] + added
            self.known[seq_id] = table
            chunks.append(SeqChunk(seq_id, start, token_ids, list(table), sample, state_slot, draft))
        return StepPlan(step_id, PlanKind(kind), chunks, freed, arg, from_device)
