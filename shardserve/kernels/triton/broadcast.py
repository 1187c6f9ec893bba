"""The first rank's token ids to every other rank of one host, in one launch, graph-capturable.

Rank 0 writes each id into every peer's word area (distributed/ipc_memory.py) as an 8-byte word: the id's
low 32 bits under the call's epoch for that row, so one NVLink write carries the id and its arrival (the
low-latency form of kernels/triton/all_reduce.py). The other ranks poll their own words until each carries
the epoch, then store the ids. Every rank keeps a counter per row and bumps it on every call, so epochs
agree because all ranks make the same calls; a word only ever holds epochs of its own row, which only grow:
a word left by an earlier call never passes for the current one.

Reuse: rank 0 writes row i's word again only in its next call, and the caller guarantees a collective
between two calls (every forward all-reduces), which rank 0 cannot pass before each peer has read the word.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton.all_reduce import await_epoch, with_epoch

# Token ids travel as 32-bit payloads.
MAX_TOKEN_ID = 2**31 - 1


# n changes with the graph bucket, BLOCK (the broadcast's capacity) does not: one compiled variant for all.
@triton.jit(do_not_specialize=["n"])
def _broadcast_kernel(x_ptr, n, word_ptrs, counter_ptr, RANK: tl.constexpr, WORLD: tl.constexpr,
                      BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    ok = rows < n
    counters = counter_ptr + rows
    epoch = tl.load(counters, mask=ok, other=0) + 1
    tl.debug_barrier()  # every warp read the old counts before they change
    tl.store(counters, epoch, mask=ok)
    if RANK == 0:
        ids = tl.load(x_ptr + rows, mask=ok, other=0)
        words = with_epoch(ids & 0xFFFFFFFF, epoch)
        for q in tl.static_range(1, WORLD):
            peer = tl.load(word_ptrs + q).to(tl.pointer_type(tl.int64))
            tl.store(peer + rows, words, mask=ok)
    else:
        own = tl.load(word_ptrs + RANK).to(tl.pointer_type(tl.int64))
        got = await_epoch(own + rows, ok, epoch)
        tl.store(x_ptr + rows, got & 0xFFFFFFFF, mask=ok)


def broadcast_ids(x: torch.Tensor, word_ptrs: torch.Tensor, counters: torch.Tensor, rank: int, world: int) -> None:
    """Overwrite x (int64 [n], contiguous, ids in [0, MAX_TOKEN_ID]) on every rank with rank 0's x. `counters`
    (int32, at least n, zeroed at first) and the word areas behind `word_ptrs` (n words each) belong to this
    broadcast alone."""
    n = x.numel()
    if n > counters.numel():
        raise ValueError(f"the token broadcast holds {counters.numel()} rows, got {n}")
    _broadcast_kernel[(1,)](x, n, word_ptrs, counters, RANK=rank, WORLD=world,
                            BLOCK=triton.next_power_of_2(counters.numel()), num_warps=4)
