"""A decode graph's inputs taken from one packed array of words: the graph's first kernel.

Before each replay the host copies a step's inputs as one array of int32 words (engine/graph_inputs.py), so a
step costs one host-to-device copy instead of one per buffer (each a copy-engine operation with a gap of a few
microseconds around it on the stream). Layout, for a graph of `size` rows:

    [0] n (live rows)   [1] table width w   [2] where live rows' token ids come from: TOKENS_KEPT,
    TOKENS_IN_WORDS or TOKENS_AT_ADDRESS   [4:6] that address (int64 [n] on the device)
    [HEADER + r]             position of row r         (size words; padding rows 0)
    [HEADER + size + r]      cache slot of row r       (padding rows -1: nothing stored)
    [HEADER + 2 size + r]    context length of row r   (padding rows 0: attention outputs zeros)
    [HEADER + 3 size + r]    token id of row r         (padding rows 0)
    [HEADER + 4 size + r]    recurrent-state slot of row r (hybrid models' linear-attention layers; padding -1)
    [HEADER + 5 size + r w]  the first w block-table entries of live row r

Program r writes row r of the static buffers. Live rows' token ids come from the words (the host has them),
from a device tensor whose address the words carry (the previous step's samples: read in stream order, after
the kernels that wrote them), or are kept (the token broadcast inside the graph writes them); padding rows'
are always written from the words, so they hold a valid id. Table entries past w are left as they were: no
block past a row's context is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HEADER = 6
ROWS = 5  # words a row has before the block tables
TOKENS_KEPT, TOKENS_IN_WORDS, TOKENS_AT_ADDRESS = 0, 1, 2
TABLE_BLOCK = 256


# n, w and size change between replays or graphs: not specialised, so one compiled variant serves every bucket.
@triton.jit(do_not_specialize=["size"])
def _unpack_kernel(words_ptr, tokens_ptr, positions_ptr, slots_ptr, lens_ptr, state_slots_ptr, tables_ptr,
                   table_stride, size, HEADER: tl.constexpr, MAX_WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(words_ptr)
    width = tl.load(words_ptr + 1)
    source = tl.load(words_ptr + 2)
    rows = words_ptr + HEADER + row
    tl.store(positions_ptr + row, tl.load(rows).to(tl.int64))
    tl.store(slots_ptr + row, tl.load(rows + size).to(tl.int64))
    tl.store(lens_ptr + row, tl.load(rows + 2 * size))
    tl.store(state_slots_ptr + row, tl.load(rows + 4 * size).to(tl.int64))
    if (source == 1) | (row >= n):  # TOKENS_IN_WORDS, or padding
        tl.store(tokens_ptr + row, tl.load(rows + 3 * size).to(tl.int64))
    elif source == 2:  # TOKENS_AT_ADDRESS
        sampled = tl.load(words_ptr.to(tl.pointer_type(tl.int64)) + 2).to(tl.pointer_type(tl.int64))
        tl.store(tokens_ptr + row, tl.load(sampled + row))
    if row < n:
        table = words_ptr + HEADER + 5 * size + row.to(tl.int64) * width
        out = tables_ptr + row.to(tl.int64) * table_stride
        for start in range(0, MAX_WIDTH, BLOCK):  # a static bound; past w every lane is masked
            cols = start + tl.arange(0, BLOCK)
            ok = cols < width
            tl.store(out + cols, tl.load(table + cols, mask=ok), mask=ok)


def unpack(words: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
           lens: torch.Tensor, state_slots: torch.Tensor, tables: torch.Tensor, size: int) -> None:
    """Write rows [0, size) of tokens and positions (int64), slots (int64), lens (int32), state_slots (int64)
    and tables (int32 [rows, max_blocks]) from `words` (int32, the layout above)."""
    _unpack_kernel[(size,)](words, tokens, positions, slots, lens, state_slots, tables, tables.stride(0), size,
                            HEADER=HEADER, MAX_WIDTH=tables.shape[1], BLOCK=TABLE_BLOCK, num_warps=1)
