"""Arrival counts: how the last program of a launch to finish a piece of work learns that it is the last.

A kernel that splits one output over several programs (the w2 GEMM summing the choices of every token, the
split-K 4-bit GEMV summing its partial products) lets each program count itself in a slot after its stores
(a barrier, then one release/acquire atomic); the program that finds every other one counted sums the pieces
in a fixed order, so results repeat bit for bit, and puts the count back to 0 for the next launch.

One buffer of zeroed int32 counts per device, never freed or replaced: CUDA graphs keep its address. Invariant:
the kernels that count run on one stream of a device at a time (the engine's forward), each waits for the kernel
before it to finish (stream order, or the wait of dependent launch), and each leaves every count at 0, so
launches one after another can share the counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ARRIVAL_SLOTS = 4096
_counts: dict[torch.device, torch.Tensor] = {}


def arrival_counts(device: torch.device, slots: int) -> torch.Tensor | None:
    """The device's zeroed counts, or None where there are fewer than `slots` or they would be made inside a
    CUDA graph capture (the first eager call on a device makes them; the start-up checks make that call)."""
    if slots > ARRIVAL_SLOTS:
        return None
    counts = _counts.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _counts[device] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return counts


@triton.jit
def last_to_arrive(counts_ptr, slot, programs):
    """Count this program in counts[slot] after all its threads' stores (the barrier orders them before the
    count, whose release/acquire publishes them); True for the one of `programs` that arrives last, which then
    sees every other program's stores and must put the count back to 0 (`leave`) once it is done."""
    tl.debug_barrier()
    return tl.atomic_add(counts_ptr + slot, 1, sem="acq_rel", scope="gpu") == programs - 1


@triton.jit
def leave(counts_ptr, slot):
    """The last program's reset of counts[slot] for the next launch."""
    tl.store(counts_ptr + slot, 0)
