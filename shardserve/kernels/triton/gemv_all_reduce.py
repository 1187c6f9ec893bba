"""A row-parallel batch-1 GEMV with the all-reduce and the residual add after it, in the same launch.

At tensor parallelism each decoder layer ends its attention and its MLP with a row-parallel projection whose
outputs are partial sums; a separate all-reduce kernel (kernels/triton/all_reduce.py) then sums them over the
ranks, adds the residual and normalises. At batch 1 that kernel is short but sits alone between two GEMVs: it
starts only once the GEMV has ended, and sends all of its data then. Here the GEMV's programs send as they go:
program p, owning output rows [p * BLOCK_N, (p + 1) * BLOCK_N),
  1. computes its rows' partial sums and rounds them to the model's dtype (as the unfused path stores them);
  2. writes them into every peer's low-latency words of the peer all-reduce (the same 8-byte words: 4 bytes of
     values and the call's epoch in one NVLink store, at the same places as a one-row message of the unfused
     kernel), at the slot the peer all-reduce gave this call, and into its own rank's words at home;
  3. counts itself (arrivals.py) and, unless it is the last of the launch to do so, ends: no program waits for
     a peer's.
The last program polls its own words for every rank's rows until each carries the epoch (most arrived while
the GEMV still streamed weights), sums them in rank order in float32 and rounds, as the unfused kernel does,
adds the residual and stores the result over it (the new residual, equal bit for bit on every rank), then
applies the next layer's RMSNorm to it: the next projection takes that as its input, as it takes the unfused
kernel's.

The epoch: every program reads the slot's counter before the dependent-launch wait (last written by the call two
or more calls back, which has completed); the last program stores the new one, once every program has read the
old.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.all_reduce import await_epoch, ll_values, ll_words, peer_addresses, with_epoch
from shardserve.kernels.triton.arrivals import arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.gemv import _preload_arg, load_first_tiles, normed_values, row_dots, swiglu_dots
from shardserve.kernels.triton.pdl import enter

# The arrival count this kernel uses (any: the kernels that count leave their counts at 0).
ARRIVAL_SLOT = tl.constexpr(0)
# Values the last program sums (and normalises) at a time, per thread: more take fewer rounds of polling, but
# registers the whole kernel must reserve (16 a thread: 141 registers in a 4-warp program instead of 80).
SUM_PER_THREAD = 8


# The slot changes between calls of one shape: not specialised, so a CUDA-graph capture never compiles a variant.
@triton.jit(do_not_specialize=["slot"])
def _gemv_all_reduce_kernel(x_ptr, w_ptr, residual_ptr, norm_w_ptr, normed_ptr, ll_ptrs, counter_ptr, arrivals_ptr,
                            slot, N, stride_wn, eps, ll_slot_words, max_rows,
                            K: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, SWIGLU: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr, SUM_BLOCK: tl.constexpr,
                            PDL: tl.constexpr, PRELOAD: tl.constexpr = 0):
    """residual += the sum over ranks of x @ w^T (SWIGLU: of silu(gate) * up for x = [gate | up]), normed =
    RMSNorm(residual) * norm_w; see the module doc. PRELOAD: weight tiles loaded before the dependent-launch wait
    (gemv._gemv_kernel)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    # Before the wait: the counter of (slot, row 0) was last written by a call two or more calls back.
    counter = counter_ptr + slot * max_rows
    epoch = tl.load(counter) + 1
    areas = peer_addresses(ll_ptrs, WORLD)
    if SWIGLU:
        enter(PDL)
        y = swiglu_dots(w_rows, x_ptr, cols, row_ok, K, BLOCK_N, BLOCK_K)
    else:
        preloaded = load_first_tiles(w_rows, cols, row_ok, K, BLOCK_K, PRELOAD)
        enter(PDL)
        y = row_dots(preloaded, w_rows, x_ptr, cols, row_ok, K, BLOCK_N, BLOCK_K, PRELOAD)
    dtype = residual_ptr.dtype.element_ty
    w = tl.arange(0, BLOCK_N // PACK)
    word_at = pid * (BLOCK_N // PACK) + w  # row 0 of a message: its first words (all_reduce.py)
    words = with_epoch(ll_words(y.to(dtype), BLOCK_N, PACK), epoch)
    sent = (slot * WORLD + RANK).to(tl.int64) * ll_slot_words + word_at
    for q in tl.static_range(WORLD):  # the peers' copies and this rank's own, at the same words
        tl.store(areas[q].to(tl.pointer_type(tl.int64)) + sent, words, mask=word_at * PACK < N)
    if last_to_arrive(arrivals_ptr, ARRIVAL_SLOT, tl.num_programs(0)):
        rstd = _sum_into_residual(areas[RANK].to(tl.pointer_type(tl.int64)), residual_ptr, slot, N, ll_slot_words,
                                  epoch, eps, dtype, RANK, WORLD, PACK, SUM_BLOCK)
        _normalise(residual_ptr, norm_w_ptr, normed_ptr, N, rstd, SUM_BLOCK)
        tl.store(counter, epoch)
        leave(arrivals_ptr, ARRIVAL_SLOT)


@triton.jit
def _sum_into_residual(own, residual_ptr, slot, N, ll_slot_words, epoch, eps, dtype: tl.constexpr,
                       RANK: tl.constexpr, WORLD: tl.constexpr, PACK: tl.constexpr, SUM_BLOCK: tl.constexpr):
    """residual += the rank-ordered sum of every rank's rows in this rank's words (the peers' polled until they
    carry `epoch`), rounded as the unfused all-reduce rounds; returns 1 / rms of the new residual."""
    w = tl.arange(0, SUM_BLOCK // PACK)
    sq = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    for start in range(0, N, SUM_BLOCK):
        word_at = start // PACK + w
        ok = word_at * PACK < N
        values = start + tl.arange(0, SUM_BLOCK)
        # This rank's words are complete (every program counted itself after storing them): read with the
        # residual, before the polls.
        mine = tl.load(own + (slot * WORLD + RANK).to(tl.int64) * ll_slot_words + word_at, mask=ok, other=0,
                       volatile=True)
        r = tl.load(residual_ptr + values, mask=values < N, other=0.0)
        acc = tl.zeros([SUM_BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            if q == RANK:
                got = mine
            else:
                got = await_epoch(own + (slot * WORLD + q).to(tl.int64) * ll_slot_words + word_at, ok, epoch)
            acc += ll_values(got, dtype, SUM_BLOCK, PACK).to(tl.float32)
        s = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + values, s, mask=values < N)
        sf = tl.where(values < N, s.to(tl.float32), 0.0)
        sq += sf * sf
    return tl.rsqrt(tl.sum(sq, 0) / N + eps)


@triton.jit
def _normalise(residual_ptr, norm_w_ptr, normed_ptr, N, rstd, SUM_BLOCK: tl.constexpr):
    """normed = RMSNorm(residual) * norm_w with 1 / rms `rstd` (gemv.normed_values: the rounding of
    fused_ops._rms_norm_kernel)."""
    tl.debug_barrier()  # the residual's new values, stored by other threads of this program, are read back
    for start in range(0, N, SUM_BLOCK):
        values = start + tl.arange(0, SUM_BLOCK)
        h = normed_values(residual_ptr, residual_ptr, norm_w_ptr, values, values < N, rstd, False)
        tl.store(normed_ptr + values, h, mask=values < N)


def fits(n: int, dtype: torch.dtype, block_n: int, ll_row_bytes: int) -> bool:
    """Whether an output of n values of dtype in row blocks of block_n fits the low-latency words of one row."""
    pack = 4 // dtype.itemsize
    return pack in (1, 2) and n % pack == 0 and block_n % pack == 0 and n * 8 // pack <= ll_row_bytes


def gemv_all_reduce(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, swiglu: bool, config: tuple[int, int, int, int], ll_ptrs: torch.Tensor,
                    counters: torch.Tensor, slot: int, ll_slot_words: int, max_rows: int, rank: int,
                    world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """residual ([1, N], contiguous) += the sum over the ranks of x @ weight^T ([N, K]; with `swiglu`, x is
    [gate | up] of 2K values and the input is silu(gate) * up), in place; returns (RMSNorm(residual) *
    norm_weight, residual). Needs the device's arrival counts made (arrivals.py: not first inside a capture) and
    `fits`."""
    block_n, block_k, num_warps, num_stages = config[:4]  # a fifth, the plain GEMV's preloaded tiles, is not used
    n, k = weight.shape
    counts = arrival_counts(weight.device, ARRIVAL_SLOT.value + 1)
    if counts is None or not fits(n, residual.dtype, block_n, ll_slot_words * 8):
        raise ValueError(f"gemv_all_reduce cannot take a {n}x{k} {residual.dtype} GEMV in blocks of {block_n} "
                         "rows here (arrival counts made inside a capture, or more words than a slot)")
    if x.numel() != (2 if swiglu else 1) * k or residual.numel() != n or not residual.is_contiguous():
        raise ValueError(f"gemv_all_reduce: input {tuple(x.shape)}, residual {tuple(residual.shape)} "
                         f"for a {n}x{k} weight")
    x = x.reshape(-1).contiguous()
    normed = torch.empty_like(residual)
    extra = {} if swiglu else _preload_arg(k, block_k)
    _gemv_all_reduce_kernel[(triton.cdiv(n, block_n),)](
        x, weight, residual, norm_weight, normed, ll_ptrs, counters, counts, slot, n, weight.stride(0), eps,
        ll_slot_words, max_rows,
        K=k, RANK=rank, WORLD=world, SWIGLU=swiglu, BLOCK_N=block_n, BLOCK_K=block_k,
        PACK=4 // residual.element_size(), SUM_BLOCK=min(triton.next_power_of_2(n), 32 * num_warps * SUM_PER_THREAD),
        num_warps=num_warps, num_stages=num_stages,
        **pdl.launch(weight.device), **extra)
    return normed, residual
