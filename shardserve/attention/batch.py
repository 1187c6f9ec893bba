"""A step's batch, flattened: which rows of the token batch belong to which sequence chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.engine.step_plan import SeqChunk


@dataclass
class StepBatch:
    """Rows [0, num_decode) are single-token chunks (one sequence each); the rest are longer chunks.

    Invariant: chunk i owns rows [row_start[i], row_start[i + 1]) of the flat token batch, and
    positions start_position, start_position + 1, ... of its sequence.
    """

    chunks: list[SeqChunk]
    block_size: int
    num_decode: int = 0
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    row_start: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seq_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: list[SeqChunk], block_size: int) -> "StepBatch":
        ordered = sorted(chunks, key=lambda c: len(c.token_ids) > 1)  # single-token chunks first
        batch = cls(ordered, block_size)
        bs = block_size
        for chunk in ordered:
            n, start = len(chunk.token_ids), chunk.start_position
            row = len(batch.token_ids)
            batch.row_start.append(row)
            batch.token_ids.extend(chunk.token_ids)
            batch.positions.extend(range(start, start + n))
            table = chunk.block_table
            batch.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                batch.num_decode += 1
            if chunk.sample:
                batch.sample_rows.append(row + n - 1)
                batch.sample_seq_ids.append(chunk.seq_id)
        batch.row_start.append(len(batch.token_ids))
        return batch

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_only(self) -> bool:
        return self.num_decode == len(self.chunks)

    def context_len(self, i: int) -> int:
        """Positions in the cache for chunk i once its tokens are stored."""
        c = self.chunks[i]
        return c.start_position + len(c.token_ids)
