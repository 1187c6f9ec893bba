"""A decode graph's static buffers, written from one packed copy by the graph's first kernel (run here in
Triton's interpreter): what every row of the graph reads, live rows and padding, whatever was there before."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the graph's first kernel is a Triton kernel (kernels/triton/graph_inputs.py)")

from shardserve.attention.batch import StepBatch  # noqa: E402
from shardserve.engine.graph_inputs import RING, GraphInputs  # noqa: E402
from shardserve.wire.step_plan import SeqChunk  # noqa: E402

MAX_BATCH, MAX_BLOCKS, BLOCK_SIZE = 8, 6, 4


def _buffers() -> GraphInputs:
    """Static buffers full of stale values, as after earlier replays."""
    return GraphInputs(torch.full((MAX_BATCH,), 77, dtype=torch.long), torch.full((MAX_BATCH,), 55, dtype=torch.long),
                       torch.full((MAX_BATCH,), 33, dtype=torch.long), torch.full((MAX_BATCH,), 22, dtype=torch.int32),
                       torch.full((MAX_BATCH,), 44, dtype=torch.long),
                       torch.full((MAX_BATCH, MAX_BLOCKS), 11, dtype=torch.int32))


def _batch(*contexts: int, state_slots: bool = True) -> StepBatch:
    """Decode chunks whose sequences hold `contexts` tokens after this step (block tables of distinct ids), each
    with a recurrent-state slot (a hybrid model's) or none."""
    chunks = []
    for i, length in enumerate(contexts):
        blocks = -(-length // BLOCK_SIZE)
        table = [100 * (i + 1) + b for b in range(blocks)]
        chunks.append(SeqChunk(i, length - 1, [1000 + i], table, True, 7 - i if state_slots else -1))
    return StepBatch.from_chunks(chunks, BLOCK_SIZE)


def _check(inputs: GraphInputs, batch: StepBatch, size: int, expected_tokens: list[int]) -> None:
    n = batch.num_decode
    assert inputs.positions[:n].tolist() == batch.positions
    assert inputs.slots[:n].tolist() == batch.slot_mapping
    assert inputs.lens[:n].tolist() == [batch.context_len(r) for r in range(n)]
    assert inputs.state_slots[:n].tolist() == batch.state_slots
    for r, chunk in enumerate(batch.chunks):
        assert inputs.tables[r, :len(chunk.block_table)].tolist() == chunk.block_table
    assert inputs.tokens[:n].tolist() == expected_tokens
    # Padding rows: nothing stored, no context, a valid token id.
    assert inputs.positions[n:size].tolist() == [0] * (size - n)
    assert inputs.slots[n:size].tolist() == [-1] * (size - n)
    assert inputs.lens[n:size].tolist() == [0] * (size - n)
    assert inputs.tokens[n:size].tolist() == [0] * (size - n)
    assert inputs.state_slots[n:size].tolist() == [-1] * (size - n), "a padding row would step a live state"


def test_one_copy_fills_every_row_of_the_graph():
    inputs = _buffers()
    batch = _batch(5, 13, 1)
    inputs.write(batch, 4, None, host_tokens=True)
    inputs.unpack(4)
    _check(inputs, batch, 4, batch.token_ids)
    # Rows past the graph's size are not the graph's: untouched.
    assert inputs.positions[4:].tolist() == [55] * (MAX_BATCH - 4)


def test_tokens_sampled_on_the_device_are_read_from_their_tensor():
    """The previous step's samples, still on the device, reach the graph's token buffer through their address."""
    inputs = _buffers()
    batch = _batch(7, 2, 21)
    sampled = torch.tensor([41, 8, 2**31 - 1])
    inputs.write(batch, 4, sampled, host_tokens=True)
    inputs.unpack(4)
    _check(inputs, batch, 4, sampled.tolist())


def test_tokens_the_graph_broadcasts_are_kept():
    """Ranks whose graph receives the tokens by the broadcast inside it write none of the live rows; padding rows
    still get a valid id."""
    inputs = _buffers()
    inputs.tokens[:2] = torch.tensor([4, 9])
    batch = _batch(7, 2)
    inputs.write(batch, 4, None, host_tokens=False)
    inputs.unpack(4)
    _check(inputs, batch, 4, [4, 9])


def test_longer_tables_and_reused_host_arrays():
    """Steps in a row through every pinned array of the ring and back, with tables that grow and shrink: each
    replay sees its own step's values."""
    inputs = _buffers()
    for step in range(2 * RING + 1):
        contexts = [1 + (step * 5 + 3 * r) % (MAX_BLOCKS * BLOCK_SIZE) for r in range(1 + step % 5)]
        batch = _batch(*contexts, state_slots=step % 3 != 0)
        size = 1 if len(contexts) == 1 else (4 if len(contexts) <= 4 else 8)
        sampled = torch.arange(len(contexts)) * 3 + step
        inputs.write(batch, size, sampled if step % 2 else None, host_tokens=True)
        inputs.unpack(size)
        _check(inputs, batch, size, sampled.tolist() if step % 2 else batch.token_ids)


def test_a_table_wider_than_the_buffers_is_cut_to_them():
    """A sequence's table can list more blocks than the graph's buffer holds only past max_model_len; the copy
    keeps to the buffer (as the attention reads no further)."""
    inputs = _buffers()
    chunk = SeqChunk(0, 3, [7], list(range(1, MAX_BLOCKS + 3)), True)
    inputs.write(StepBatch.from_chunks([chunk], BLOCK_SIZE), 1, None, host_tokens=True)
    inputs.unpack(1)
    assert inputs.tables[0].tolist() == list(range(1, MAX_BLOCKS + 1))
