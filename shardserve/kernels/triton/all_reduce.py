"""One-shot all-reduce between the GPUs of one host, optionally fused with the residual add and RMSNorm
that follow it in a decoder layer; one launch, graph-capturable.

Each rank owns a receive area and a flag area in memory every peer can write (distributed/ipc_memory.py).
Program `row` of a call at slot s on rank r:
  1. stores its row of the partial sum x into every peer's receive area at [s][r][row] (NVLink writes);
  2. bumps its own counter for (s, row): the call's epoch, the same on every rank because every rank makes
     the same calls at the same slots;
  3. after a CTA barrier, release-stores the epoch into each peer's flag (s, row, r): the data before it is
     visible to that peer once the flag is;
  4. acquire-polls its own flags (s, row, q) until every peer's epoch arrived, then sums the rows in rank
     order in float32 (every rank adds the same numbers in the same order: results equal bit for bit),
     rounds to the dtype like the unfused all-reduce, and optionally adds the residual and normalises with
     exactly the rounding of fused_ops._rms_norm_kernel.
Slot reuse: a rank writes slot s again only two calls later (the caller alternates slots), and by then each
peer has started the call in between, so (in stream order) it has finished reading slot s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The norm's sum of squares must reduce in the same order as fused_ops' kernel: the same warps per row.
from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.fused_ops import _row_warps
from shardserve.kernels.triton.pdl import enter


# The slot changes between calls of one shape: not specialised, so a CUDA-graph capture never compiles a variant.
@triton.jit(do_not_specialize=["slot"])
def _one_shot_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, data_ptrs, flag_ptrs, counter_ptr,
                     slot, n_cols, eps, slot_numel, max_rows,
                     RANK: tl.constexpr, WORLD: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)  # before any read of x and any write to a peer (pdl.py)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offset = row.to(tl.int64) * n_cols + cols
    x = tl.load(x_ptr + offset, mask=mask, other=0.0)
    dtype = x.dtype
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer = tl.load(data_ptrs + q).to(tl.pointer_type(dtype))
            tl.store(peer + (slot * WORLD + RANK).to(tl.int64) * slot_numel + offset, x, mask=mask)
    counter = counter_ptr + slot * max_rows + row
    epoch = tl.load(counter) + 1
    tl.debug_barrier()  # every warp has read the old count before it changes: all hold the same epoch
    tl.store(counter, epoch)
    tl.debug_barrier()  # every thread's stores above come before the release below
    flag_index = (slot * max_rows + row) * WORLD
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer_flags = tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + flag_index + RANK, epoch, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        if q != RANK:
            seen = tl.atomic_add(own_flags + flag_index + q, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(own_flags + flag_index + q, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    received = tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            acc += x.to(tl.float32)
        else:
            part = tl.load(received + (slot * WORLD + q).to(tl.int64) * slot_numel + offset, mask=mask, other=0.0,
                           volatile=True)
            acc += part.to(tl.float32)
    s = acc.to(dtype)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + offset, mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + offset, s, mask=mask)
    if NORM:
        h = s.to(tl.float32)
        mean_sq = tl.sum(h * h, 0) / n_cols
        h = (h * tl.rsqrt(mean_sq + eps)).to(dtype)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        s = (w.to(tl.float32) * h.to(tl.float32)).to(dtype)
    tl.store(out_ptr + offset, s, mask=mask)


def one_shot(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
             data_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, counters: torch.Tensor, slot: int,
             slot_numel: int, max_rows: int, rank: int, world: int) -> torch.Tensor:
    """Sum x ([rows, cols], contiguous) over the ranks, in place. With `residual`: residual += sum (in place),
    and with `weight`: x becomes RMSNorm(residual) * weight. Returns x."""
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    _one_shot_kernel[(rows,)](x, residual if residual is not None else x, weight if weight is not None else x, x,
                              data_ptrs, flag_ptrs, counters, slot, cols, eps, slot_numel, max_rows,
                              RANK=rank, WORLD=world, ADD_RESIDUAL=residual is not None, NORM=weight is not None,
                              BLOCK=block, num_warps=_row_warps(block), **pdl.launch(x.device))
    return x
