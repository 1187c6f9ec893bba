"""The token-broadcast kernel (kernels/triton/broadcast.py): rank 0's ids reach every other rank exactly, over
calls of changing widths, with each row's word carrying that row's current epoch.

Without CUDA the kernel runs in Triton's interpreter with the ranks played one after another in this process
(rank 0 first, so no rank waits): each rank's word area is a host tensor whose address stands in the peers'
mapped memory. The same kernel between two GPUs, eagerly and in CUDA graphs, is checked by
tests/distributed/test_peer_all_reduce.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the two-GPU form runs in tests/distributed"),
]

WORLD = 3
CAPACITY = 24


def _ranks():
    areas = [torch.zeros(CAPACITY, dtype=torch.int64) for _ in range(WORLD)]
    pointers = torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64)
    counters = [torch.zeros(CAPACITY, dtype=torch.int32) for _ in range(WORLD)]
    return areas, pointers, counters


def test_every_rank_receives_rank_zeros_ids_over_calls_of_changing_widths():
    from shardserve.kernels.triton.broadcast import MAX_TOKEN_ID, broadcast_ids

    areas, pointers, counters = _ranks()
    calls = [1, 5, 3, CAPACITY, 2]
    for call, n in enumerate(calls):
        g = torch.Generator().manual_seed(call)
        sent = torch.randint(0, 152_000, (n,), generator=g, dtype=torch.int64)
        sent[0] = MAX_TOKEN_ID if call % 2 else 0  # the payload's extremes
        first = sent.clone()
        broadcast_ids(first, pointers, counters[0], 0, WORLD)
        assert torch.equal(first, sent), "rank 0's ids changed"
        for rank in range(1, WORLD):
            x = torch.full((n,), -1, dtype=torch.int64)
            broadcast_ids(x, pointers, counters[rank], rank, WORLD)
            assert torch.equal(x, sent), f"call {call} ({n} ids): rank {rank} received {x.tolist()}"
    # A row's word carries the epoch of the row's last call: the number of calls that covered it.
    expected = torch.tensor([sum(n > row for n in calls) for row in range(CAPACITY)], dtype=torch.int32)
    for rank in range(WORLD):
        assert torch.equal(counters[rank], expected), f"rank {rank}'s counts"
    for rank in range(1, WORLD):
        assert torch.equal((areas[rank] >> 32).to(torch.int32), expected), f"rank {rank}'s word epochs"
    assert not areas[0].any(), "rank 0 received words"


def test_more_ids_than_the_broadcast_holds_is_an_error_naming_both_counts():
    from shardserve.kernels.triton.broadcast import broadcast_ids

    _, pointers, counters = _ranks()
    with pytest.raises(ValueError, match=f"holds {CAPACITY} rows, got {CAPACITY + 1}"):
        broadcast_ids(torch.zeros(CAPACITY + 1, dtype=torch.int64), pointers, counters[0], 0, WORLD)
