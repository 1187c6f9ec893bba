"""A step's batch, flattened: which rows of the token batch belong to which sequence chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.wire.step_plan import SeqChunk


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
    state_slots: list[int] = field(default_factory=list)  # chunk i's slot in the recurrent-state pools (or -1)
    # Several rows of one sequence, each a one-token chunk (decode_rows): a row attends to the keys its sequence's
    # earlier rows store in the same step, so they must be in the cache before any row attends.
    rows_share_sequences: bool = False

    @classmethod
    def from_chunks(cls, chunks: list[SeqChunk], block_size: int) -> "StepBatch":
        ordered = sorted(chunks, key=lambda c: len(c.token_ids) > 1)  # single-token chunks first
        batch = cls(ordered, block_size)
        bs = block_size
        # Called for every step on every rank (at batch 512, 512 decode chunks): the lists' methods are bound once.
        token_ids, positions, slots = batch.token_ids, batch.positions, batch.slot_mapping
        row_start, sample_rows, sample_seq_ids = batch.row_start, batch.sample_rows, batch.sample_seq_ids
        batch.state_slots = [c.state_slot for c in ordered]
        for chunk in ordered:
            tokens, start, table = chunk.token_ids, chunk.start_position, chunk.block_table
            n = len(tokens)
            row = len(token_ids)
            row_start.append(row)
            token_ids.extend(tokens)
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                batch.num_decode += 1
            else:
                positions.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if chunk.draft:  # a verified chunk: the rows of its last token and of each proposal (speculative.py)
                sample_rows.extend(range(row + n - 1 - chunk.draft, row + n))
                sample_seq_ids.extend([chunk.seq_id] * (chunk.draft + 1))
            elif chunk.sample:
                sample_rows.append(row + n - 1)
                sample_seq_ids.append(chunk.seq_id)
        row_start.append(len(token_ids))
        return batch

    @classmethod
    def decode_rows(cls, chunks: list[SeqChunk], block_size: int) -> "StepBatch":
        """The chunks' tokens as one-token chunks, one a row in plan order: a decode-only batch, which the decode
        graphs replay, computing what from_chunks's batch computes. A row's context ends at its own position, so
        causality within a chunk comes from the context lengths; the rows that sample are from_chunks's. For short
        chunks only (verifying k proposals: k + 1 rows of one sequence): every row reads its whole context."""
        rows = []
        for c in chunks:
            n = len(c.token_ids)
            sampled = c.draft + 1 if c.draft else int(c.sample)
            rows.extend(SeqChunk(c.seq_id, c.start_position + j, [token], c.block_table, j >= n - sampled,
                                 c.state_slot) for j, token in enumerate(c.token_ids))
        batch = cls.from_chunks(rows, block_size)
        batch.rows_share_sequences = len(rows) > len(chunks)
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
