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
