"""A decode step's inputs for its CUDA graph in one host-to-device copy, unpacked inside the graph.

The host writes positions, cache slots, context lengths, recurrent-state slots, block tables and (where it has
them) the token ids of
a step into one array of int32 words in pinned memory and queues one copy of it; the graph's first kernel
writes them into the static buffers the graph reads (kernels/triton/graph_inputs.py has the layout), and takes
the token ids sampled on the device by the previous step from their own tensor, whose address the words carry.
Before, each buffer took a copy of its own, the tokens a device-to-device one: five copy-engine operations
between two replays, each with a gap on the stream around it.

Pinned arrays are reused in a ring. Invariant: an array is written again only once the copy that read it has
completed (an event per array; the host checks it, which in practice never waits: the ring is longer than the
number of steps the host queues ahead).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from shardserve.attention.batch import StepBatch

RING = 4


class GraphInputs:
    def __init__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                 state_slots: torch.Tensor, tables: torch.Tensor) -> None:
        """The static buffers a graph reads: tokens and positions int64 [max_batch], slots int64, lens int32,
        state_slots int64, tables int32 [max_batch, max_blocks]."""
        # Imported here: Triton exists where CUDA graphs do, and engines without them (CPUs) must not need it.
        from shardserve.kernels.triton import graph_inputs as kernel

        self.kernel = kernel  # the layout of the words, and the kernel that unpacks them
        self.tokens, self.positions, self.slots, self.lens = tokens, positions, slots, lens
        self.state_slots, self.tables = state_slots, tables
        max_batch, self.max_blocks = tables.shape
        capacity = kernel.HEADER + kernel.ROWS * max_batch + max_batch * self.max_blocks
        device = tokens.device
        self.words = torch.zeros(capacity, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host = [torch.zeros(capacity, dtype=torch.int32, pin_memory=pin) for _ in range(RING)]
        self._copied: list[torch.cuda.Event | None] = [None] * RING
        self._held: list[torch.Tensor | None] = [None] * RING  # each array's device tokens, while it is in use
        self._next = 0

    def write(self, batch: StepBatch, size: int, device_tokens: torch.Tensor | None, host_tokens: bool) -> None:
        """Queue the copy of `batch`'s inputs for the graph of `size` rows. The live rows' token ids: read from
        `device_tokens` (int64 [n], contiguous, on the graph's device and stream: its memory is reused only
        after the graph, in stream order), else from the batch with host_tokens, else kept as the graph finds
        them (the token broadcast writes them)."""
        k = self.kernel
        n = batch.num_decode
        width = min(max((len(c.block_table) for c in batch.chunks[:n]), default=0), self.max_blocks)
        length = k.HEADER + k.ROWS * size + n * width
        i, self._next = self._next, (self._next + 1) % RING
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        host = self._host[i]
        words = host.numpy()
        source = (k.TOKENS_AT_ADDRESS if device_tokens is not None else k.TOKENS_IN_WORDS if host_tokens
                  else k.TOKENS_KEPT)
        words[:4] = (n, width, source, 0)
        words[4:k.HEADER] = np.array([0 if device_tokens is None else device_tokens.data_ptr()], np.int64).view(np.int32)
        self._held[i] = device_tokens
        body = words[k.HEADER:k.HEADER + k.ROWS * size].reshape(k.ROWS, size)
        # Padding rows: position 0, no cache slot, no context, token 0, no state slot.
        body[:, n:] = ((0,), (-1,), (0,), (0,), (-1,))
        body[0, :n] = batch.positions[:n]
        body[1, :n] = batch.slot_mapping[:n]
        np.add(body[0, :n], 1, out=body[2, :n])  # a one-token row's context ends at its position
        if source == k.TOKENS_IN_WORDS:
            body[3, :n] = batch.token_ids[:n]
        if batch.state_slots:
            body[4, :n] = batch.state_slots[:n]
        _fill_tables(words[k.HEADER + k.ROWS * size:length].reshape(n, width), [c.block_table for c in batch.chunks[:n]])
        self.words[:length].copy_(host[:length], non_blocking=True)
        if self.words.is_cuda:
            event = self._copied[i] or torch.cuda.Event()
            event.record()
            self._copied[i] = event

    def unpack(self, size: int) -> None:
        """The graph's first kernel: rows [0, size) of the static buffers from the words last copied."""
        self.kernel.unpack(self.words, self.tokens, self.positions, self.slots, self.lens, self.state_slots,
                           self.tables, size)


def _fill_tables(out: np.ndarray, tables: list[list[int]]) -> None:
    """out [rows, width] = each row's block table, zero past its end (a table longer than width is cut), in a
    few numpy calls instead of two slice assignments a row."""
    width = out.shape[1]
    lens = np.fromiter(map(len, tables), np.int64, count=len(tables))
    if len(tables) and lens.max() > width:
        tables = [t[:width] for t in tables]
        np.minimum(lens, width, out=lens)
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, count=int(lens.sum()))
    out[:] = 0
    out[np.arange(width)[None, :] < lens[:, None]] = flat
