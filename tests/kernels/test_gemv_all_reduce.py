"""The row-parallel GEMV with the all-reduce, residual add and next norm in its launch
(kernels/triton/gemv_all_reduce.py): each rank's new residual is the rank-ordered sum of the ranks' rounded partial
products plus the old residual, bit for bit what the GEMV followed by the unfused all-reduce gives, and its
normed output that of the norm kernel; the words it leaves in the peers' areas carry the call's epoch, and the
slot's counter moves on once per call.

Without CUDA the kernel runs in Triton's interpreter with two ranks played one after another in this process:
rank 1's words for rank 0 are written first, from its partial products computed by the plain GEMV, in the
format the one-shot all-reduce uses; rank 0's kernel then finds them, and rank 1's kernel finds rank 0's. The
two-GPU form runs in tests/distributed/test_peer_all_reduce.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the two-GPU form runs in tests/distributed"),
]

WORLD = 2
SLOTS, MAX_ROWS, SLOT_WORDS = 3, 4, 64
EPS = 1e-5


def _words(values: torch.Tensor, epoch: int) -> torch.Tensor:
    """The low-latency words of a row of values (all_reduce.py's format), under `epoch`."""
    if values.element_size() == 2:
        bits = values.view(torch.int16).to(torch.int64) & 0xFFFF
        payload = bits[0::2] | (bits[1::2] << 16)
    else:
        payload = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (epoch << 32) | payload


class Ranks:
    """Two ranks' word areas (host tensors whose addresses stand in for peer memory) and counters."""

    def __init__(self) -> None:
        self.areas = [torch.zeros(SLOTS * WORLD * SLOT_WORDS, dtype=torch.int64) for _ in range(WORLD)]
        self.pointers = torch.tensor([a.data_ptr() for a in self.areas], dtype=torch.int64)
        self.counters = [torch.zeros(SLOTS * MAX_ROWS, dtype=torch.int32) for _ in range(WORLD)]

    def words_from(self, sender: int, receiver: int, slot: int, n_words: int) -> torch.Tensor:
        start = (slot * WORLD + sender) * SLOT_WORDS
        return self.areas[receiver][start:start + n_words]


def rms_norm(x, weight, eps):
    from shardserve.kernels.triton.fused_ops import rms_norm

    return rms_norm(x, weight, eps)


def _reference64(x, w, swiglu):
    """x @ w^T in float64 (of silu(gate) * up with `swiglu`), the input rounded as the kernels round it."""
    if swiglu:
        from shardserve.kernels.triton.fused_ops import silu_and_mul

        x = silu_and_mul(x)
    return x.double() @ w.double().T


def _partial(x, w, swiglu, config):
    from shardserve.kernels.triton.gemv import gemv, gemv_swiglu

    return (gemv_swiglu if swiglu else gemv)(x, w, *config).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("n,config", [(24, (8, 64, 4, 1)), (20, (8, 32, 4, 1)), (32, (4, 64, 4, 1))])
def test_both_ranks_get_the_rank_ordered_sum_plus_the_residual(dtype, swiglu, n, config):
    from shardserve.kernels.triton.gemv_all_reduce import gemv_all_reduce

    k = 96
    g = torch.Generator().manual_seed(n + k + swiglu)
    ranks = Ranks()
    weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(WORLD)]
    inputs = [torch.randn(1, (2 if swiglu else 1) * k, generator=g).to(dtype) for _ in range(WORLD)]
    partials = [_partial(x, w, swiglu, config) for x, w in zip(inputs, weights)]
    slot = 1
    norm_weight = torch.rand(n, generator=g).add_(0.5).to(dtype)
    for call in range(1, 3):  # two calls at one slot: the epoch moves on
        start = torch.randn(1, n, generator=g).to(dtype)
        expected = ((partials[0].float() + partials[1].float()).to(dtype).float() + start.float()).to(dtype)
        expected_normed = rms_norm(expected, norm_weight, EPS)
        pack = 4 // dtype.itemsize
        # Rank 1's words for rank 0, as its kernel would store them (rank 0 runs first).
        ranks.words_from(1, 0, slot, n // pack).copy_(_words(partials[1], call))
        for rank in range(WORLD):
            residual = start.clone()
            normed, summed = gemv_all_reduce(inputs[rank], weights[rank], residual, norm_weight, EPS, swiglu, config,
                                             ranks.pointers, ranks.counters[rank], slot, SLOT_WORDS, MAX_ROWS, rank,
                                             WORLD)
            assert summed is residual
            assert torch.equal(residual, expected), f"rank {rank}, call {call}"
            # And against float64: the whole sharded product plus the residual, rounded once per rank's part.
            reference = start.double() + sum(_reference64(x, w, swiglu) for x, w in zip(inputs, weights))
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(residual.double(), reference, atol=tol * k ** 0.5, rtol=tol)
            # The sum of squares is reduced in another order than the norm kernel's: the last bit may differ.
            torch.testing.assert_close(normed, expected_normed, atol=0, rtol=2e-3 if dtype == torch.float16 else 1e-6)
            assert ranks.counters[rank][slot * MAX_ROWS] == call
            assert ranks.counters[rank].sum() == call, "only the slot's first row counts this call"
        # What rank 0 left in rank 1's area: its partial products under this call's epoch.
        assert torch.equal(ranks.words_from(0, 1, slot, n // pack), _words(partials[0], call))


def test_the_arrival_count_is_back_to_zero_after_a_call():
    from shardserve.kernels.triton.arrivals import arrival_counts
    from shardserve.kernels.triton.gemv_all_reduce import ARRIVAL_SLOT, gemv_all_reduce

    ranks = Ranks()
    w, x = torch.randn(16, 64), torch.randn(1, 64)
    partial = _partial(x, w, False, (4, 64, 4, 1))
    ranks.words_from(1, 0, 0, 16).copy_(_words(partial, 1))
    gemv_all_reduce(x, w, torch.zeros(1, 16), torch.ones(16), EPS, False, (4, 64, 4, 1), ranks.pointers,
                    ranks.counters[0], 0, SLOT_WORDS, MAX_ROWS, 0, WORLD)
    assert arrival_counts(torch.device("cpu"), 1)[ARRIVAL_SLOT.value] == 0
