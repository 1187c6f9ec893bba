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
Small messages take a low-latency form instead (NCCL's LL protocol): each 8-byte word a rank writes into a
peer's separate word area holds 4 bytes of its row and the call's epoch; the peer polls the words themselves
until every one carries the epoch, so the data and its arrival cross NVLink in one write, with no flag and no
fence between them (8-byte stores arrive whole). The area starts zeroed and epochs start at 1. Row r of every
message lives at the same words of a slot whatever the width, so a word only ever holds epochs of (s, r), which
only grow: a word left by an earlier call, of any shape, never passes for the current one.
Slot reuse: a rank writes slot s again only two calls later (the caller alternates slots), and by then each
peer has started the call in between, so (in stream order) it has finished reading slot s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
# The norm's sum of squares must reduce in the same order as fused_ops' kernel: the same warps per row.
from shardserve.kernels.triton.fused_ops import _row_warps
from shardserve.kernels.triton.pdl import enter


@triton.jit
def _take_epoch(counter, old):
    """The call's epoch for its (slot, row): the counter's old value plus one, stored back; the same in every
    warp."""
    epoch = old + 1
    tl.debug_barrier()  # every warp has read the old count before it changes: all hold the same epoch
    tl.store(counter, epoch)
    return epoch


@triton.jit
def peer_addresses(table_ptr, WORLD: tl.constexpr):
    """Every rank's area as seen from here: a tuple of WORLD addresses."""
    areas = ()
    for q in tl.static_range(WORLD):
        areas = areas + (tl.load(table_ptr + q),)
    return areas


@triton.jit
def _ll_payload(x_ptr, offset, n_cols, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """The row at offset as the low halves of 8-byte words: 4 bytes of values each (two 16-bit or one 32-bit),
    as uint32 in int64. (Read again from memory, where it is cached: pairing the values already in registers
    costs a layout conversion through shared memory, with a barrier per chunk.)"""
    i = tl.arange(0, BLOCK // PACK)
    if PACK == 2:
        lo = tl.load(x_ptr + offset + 2 * i, mask=2 * i < n_cols, other=0.0)
        hi = tl.load(x_ptr + offset + 2 * i + 1, mask=2 * i + 1 < n_cols, other=0.0)
        payload = (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | \
            (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    else:
        payload = tl.load(x_ptr + offset + i, mask=i < n_cols, other=0.0).to(tl.int32, bitcast=True)
    return payload.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def ll_words(values, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """As _ll_payload for BLOCK values already in registers (a GEMV's output rows): value 2i in the low two bytes
    of word i, value 2i + 1 in the high two (PACK 2), or one 32-bit value a word (PACK 1)."""
    if PACK == 2:
        lo, hi = tl.split(tl.reshape(values, (BLOCK // 2, 2)))
        payload = (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | \
            (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    else:
        payload = values.to(tl.int32, bitcast=True)
    return payload.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def with_epoch(payload, epoch):
    """Low-latency words: each payload (uint32 in int64) under its epoch in the high half."""
    return (epoch.to(tl.int64) << 32) | payload


@triton.jit
def await_epoch(at, ok, epoch):
    """The words at `at` (where ok), polled uncached until every one carries `epoch` in its high half."""
    got = tl.load(at, mask=ok, other=0, volatile=True)
    while tl.sum((ok & ((got >> 32).to(tl.int32) != epoch)).to(tl.int32), 0) > 0:
        got = tl.load(at, mask=ok, other=0, volatile=True)
    return got


@triton.jit
def ll_values(words, dtype: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """The values of words made from _ll_payload, in column order."""
    payload = words.to(tl.int32)  # the low half
    if PACK == 2:
        lo = payload.to(tl.int16).to(dtype, bitcast=True)
        hi = (payload >> 16).to(tl.int16).to(dtype, bitcast=True)
        values = tl.join(lo, hi).reshape(BLOCK)
    else:
        values = payload.to(dtype, bitcast=True)
    return values


# The slot changes between calls of one shape: not specialised, so a CUDA-graph capture never compiles a variant.
@triton.jit(do_not_specialize=["slot"])
def _one_shot_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, data_ptrs, flag_ptrs, ll_ptrs, counter_ptr,
                     slot, n_cols, eps, slot_numel, ll_slot_words, ll_row_words, max_rows,
                     RANK: tl.constexpr, WORLD: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr,
                     BLOCK: tl.constexpr, LL: tl.constexpr, PACK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offset = row.to(tl.int64) * n_cols + cols
    # Read before the wait (pdl.py): the address tables never change, and (slot, row)'s counter was last written
    # by the call two or more calls back (slots alternate), which is complete once this call's programs run.
    counter = counter_ptr + slot * max_rows + row
    old_epoch = tl.load(counter)
    if LL:
        areas = peer_addresses(ll_ptrs, WORLD)
    else:
        areas = peer_addresses(data_ptrs, WORLD)
        flags = peer_addresses(flag_ptrs, WORLD)
    enter(PDL)  # before any read of x and any write to a peer
    x = tl.load(x_ptr + offset, mask=mask, other=0.0)
    dtype = x.dtype
    # Loaded before the exchange, so their latency hides behind the peers' writes instead of following them.
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + offset, mask=mask, other=0.0)
    if NORM:
        norm_w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if LL:
        # Low-latency form: each 8-byte word carries its epoch, so one NVLink write per word delivers the data
        # and says it arrived; no flag, no fence.
        payload = _ll_payload(x_ptr, row.to(tl.int64) * n_cols, n_cols, BLOCK, PACK)  # loads before the barrier
        epoch = _take_epoch(counter, old_epoch)
        words = with_epoch(payload, epoch)
        w = tl.arange(0, BLOCK // PACK)
        word_ok = w * PACK < n_cols
        word_at = row.to(tl.int64) * ll_row_words + w  # a row's words are always its own: see the module doc
        for q in tl.static_range(WORLD):
            if q != RANK:
                peer = areas[q].to(tl.pointer_type(tl.int64))
                tl.store(peer + (slot * WORLD + RANK).to(tl.int64) * ll_slot_words + word_at, words, mask=word_ok)
        own = areas[RANK].to(tl.pointer_type(tl.int64))
        for q in tl.static_range(WORLD):
            if q == RANK:
                acc += x.to(tl.float32)
            else:
                got = await_epoch(own + (slot * WORLD + q).to(tl.int64) * ll_slot_words + word_at, word_ok, epoch)
                acc += tl.where(mask, ll_values(got, dtype, BLOCK, PACK), 0.0).to(tl.float32)
    else:
        for q in tl.static_range(WORLD):
            if q != RANK:
                peer = areas[q].to(tl.pointer_type(dtype))
                tl.store(peer + (slot * WORLD + RANK).to(tl.int64) * slot_numel + offset, x, mask=mask)
        epoch = _take_epoch(counter, old_epoch)
        tl.debug_barrier()  # every thread's stores above come before the release below
        flag_index = (slot * max_rows + row) * WORLD
        for q in tl.static_range(WORLD):
            if q != RANK:
                peer_flags = flags[q].to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer_flags + flag_index + RANK, epoch, sem="release", scope="sys")
        own_flags = flags[RANK].to(tl.pointer_type(tl.int32))
        for q in tl.static_range(WORLD):
            if q != RANK:
                seen = tl.atomic_add(own_flags + flag_index + q, 0, sem="acquire", scope="sys")
                while seen < epoch:
                    seen = tl.atomic_add(own_flags + flag_index + q, 0, sem="acquire", scope="sys")
        tl.debug_barrier()
        received = areas[RANK].to(tl.pointer_type(dtype))
        for q in tl.static_range(WORLD):
            if q == RANK:
                acc += x.to(tl.float32)
            else:
                part = tl.load(received + (slot * WORLD + q).to(tl.int64) * slot_numel + offset, mask=mask,
                               other=0.0, volatile=True)
                acc += part.to(tl.float32)
    s = acc.to(dtype)
    if ADD_RESIDUAL:
        s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + offset, s, mask=mask)
    if NORM:
        h = s.to(tl.float32)
        mean_sq = tl.sum(h * h, 0) / n_cols
        h = (h * tl.rsqrt(mean_sq + eps)).to(dtype)
        s = (norm_w.to(tl.float32) * h.to(tl.float32)).to(dtype)
    tl.store(out_ptr + offset, s, mask=mask)


def one_shot(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
             data_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, ll_ptrs: torch.Tensor, counters: torch.Tensor,
             slot: int, slot_numel: int, ll_rows: int, ll_row_bytes: int, max_rows: int, rank: int,
             world: int) -> torch.Tensor:
    """Sum x ([rows, cols], contiguous) over the ranks, in place. With `residual`: residual += sum (in place),
    and with `weight`: x becomes RMSNorm(residual) * weight. Returns x. Messages of up to ll_rows rows whose
    words fit ll_row_bytes a row (16-bit rows of an even width, or 32-bit) take the low-latency form."""
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    pack = 4 // x.element_size()
    ll = (pack in (1, 2) and cols % pack == 0 and block >= pack and rows <= ll_rows
          and cols * 8 // pack <= ll_row_bytes)
    _one_shot_kernel[(rows,)](x, residual if residual is not None else x, weight if weight is not None else x, x,
                              data_ptrs, flag_ptrs, ll_ptrs, counters, slot, cols, eps, slot_numel,
                              ll_rows * ll_row_bytes // 8, ll_row_bytes // 8, max_rows, RANK=rank, WORLD=world,
                              ADD_RESIDUAL=residual is not None,
                              NORM=weight is not None, BLOCK=block, LL=ll, PACK=max(pack, 1),
                              num_warps=_row_warps(block), **pdl.launch(x.device))
    return x
