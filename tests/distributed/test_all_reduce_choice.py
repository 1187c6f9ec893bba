"""Choosing the all-reduce method from measured timings: the fastest per message size, per mode."""

from __future__ import annotations

import torch

from shardserve.distributed.all_reduce import (NCCL, NCCL_EAGER_PIECES, SYMM_ONE_SHOT, SYMM_TWO_SHOT,
                                               AllReduceMethod, _choose)

KIB = 1024


class FakeMethod(AllReduceMethod):
    def __init__(self, name: str, max_bytes: int | None = None) -> None:
        self.name = name
        self.max_bytes = max_bytes

    def supports(self, x: torch.Tensor) -> bool:
        return self.max_bytes is None or x.numel() * x.element_size() <= self.max_bytes


def _methods():
    return [FakeMethod(NCCL), FakeMethod(SYMM_ONE_SHOT, 512 * KIB), FakeMethod(SYMM_TWO_SHOT, 512 * KIB)]


SIZES = [8 * KIB, 64 * KIB, 512 * KIB, 4096 * KIB]


def _bf16(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 2, dtype=torch.bfloat16)


def test_nvlink_like_timings_pick_symmetric_memory_for_small_messages_and_nccl_for_large():
    timings = {  # microseconds, shaped like the H200 anchors: graph NCCL beats eager NCCL
        f"{NCCL}/graph": {8 * KIB: 18.3, 64 * KIB: 20.0, 512 * KIB: 30.0, 4096 * KIB: 60.0},
        f"{NCCL_EAGER_PIECES}/eager": {8 * KIB: 35.2, 64 * KIB: 36.0, 512 * KIB: 45.0, 4096 * KIB: 70.0},
        f"{SYMM_ONE_SHOT}/graph": {8 * KIB: 6.3, 64 * KIB: 9.0, 512 * KIB: 40.0},
        f"{SYMM_ONE_SHOT}/eager": {8 * KIB: 8.9, 64 * KIB: 11.0, 512 * KIB: 42.0},
        f"{SYMM_TWO_SHOT}/graph": {8 * KIB: 9.0, 64 * KIB: 12.0, 512 * KIB: 25.0},
        f"{SYMM_TWO_SHOT}/eager": {8 * KIB: 12.0, 64 * KIB: 14.0, 512 * KIB: 28.0},
    }
    choice = _choose(_methods(), timings, SIZES, forced=None)
    assert not choice.split_sizes, "NCCL inside graphs is faster here: graphs must stay whole"
    assert choice.graph.pick(_bf16(8 * KIB)).name == SYMM_ONE_SHOT
    assert choice.graph.pick(_bf16(64 * KIB)).name == SYMM_ONE_SHOT
    assert choice.graph.pick(_bf16(512 * KIB)).name == SYMM_TWO_SHOT
    assert choice.graph.pick(_bf16(4096 * KIB)).name == NCCL
    assert choice.graph.pick(_bf16(64 * 1024 * KIB)).name == NCCL, "beyond every measured size: NCCL"
    assert choice.eager.pick(_bf16(8 * KIB)).name == SYMM_ONE_SHOT
    assert "symm-one-shot" in choice.describe() and "nccl" in choice.describe()


def test_eager_nccl_faster_than_in_graph_splits_the_graphs():
    timings = {  # shaped like GB10 + RoCE: 18 us eager vs 46 us in a graph, no symmetric memory
        f"{NCCL}/graph": {8 * KIB: 46.0, 64 * KIB: 48.0, 512 * KIB: 60.0, 4096 * KIB: 200.0},
        f"{NCCL_EAGER_PIECES}/eager": {8 * KIB: 18.0, 64 * KIB: 20.0, 512 * KIB: 58.0, 4096 * KIB: 230.0},
    }
    choice = _choose([FakeMethod(NCCL)], timings, SIZES, forced=None)
    assert choice.split_sizes == {8 * KIB, 64 * KIB}, "split only where eager wins by more than the margin"
    assert "split graphs" in choice.describe()
    assert choice.eager.pick(_bf16(8 * KIB)).name == NCCL


def test_a_forced_method_wins_regardless_of_timings():
    timings = {f"{NCCL}/graph": {8 * KIB: 1.0}, f"{NCCL_EAGER_PIECES}/eager": {8 * KIB: 2.0},
               f"{SYMM_TWO_SHOT}/graph": {8 * KIB: 50.0}, f"{SYMM_TWO_SHOT}/eager": {8 * KIB: 50.0}}
    choice = _choose(_methods(), timings, [8 * KIB], forced=SYMM_TWO_SHOT)
    assert choice.graph.pick(_bf16(8 * KIB)).name == SYMM_TWO_SHOT
    forced_pieces = _choose(_methods(), timings, [8 * KIB], forced=NCCL_EAGER_PIECES)
    assert forced_pieces.split_sizes == {8 * KIB}


def test_a_failed_method_is_never_chosen():
    inf = float("inf")
    timings = {f"{NCCL}/graph": {8 * KIB: 20.0}, f"{NCCL_EAGER_PIECES}/eager": {8 * KIB: 30.0},
               f"{SYMM_ONE_SHOT}/graph": {8 * KIB: inf}, f"{SYMM_ONE_SHOT}/eager": {8 * KIB: inf}}
    choice = _choose(_methods(), timings, [8 * KIB], forced=None)
    assert choice.graph.pick(_bf16(8 * KIB)).name == NCCL


def test_eager_nccl_winning_at_large_sizes_does_not_split_small_graphs():
    """Measured on 2x H200 (NVLink), microseconds: eager NCCL beats NCCL-in-graph from 2 MiB up, but the
    batch-1 graph (8 KiB messages) must keep symmetric memory in the graph at 7.4 us, not go eager at 25 us."""
    timings = {
        f"{NCCL}/graph": {8 * KIB: 14.84, 512 * KIB: 16.0, 2048 * KIB: 32.65, 4096 * KIB: 37.5},
        f"{NCCL_EAGER_PIECES}/eager": {8 * KIB: 25.14, 512 * KIB: 23.2, 2048 * KIB: 28.32, 4096 * KIB: 62.92},
        f"{SYMM_ONE_SHOT}/graph": {8 * KIB: 7.42, 512 * KIB: 10.86},
        f"{SYMM_ONE_SHOT}/eager": {8 * KIB: 18.54, 512 * KIB: 18.31},
    }
    sizes = [8 * KIB, 512 * KIB, 2048 * KIB, 4096 * KIB]
    choice = _choose(_methods(), timings, sizes, forced=None)
    assert not choice.split_graph(8 * KIB) and not choice.split_graph(512 * KIB)
    assert choice.graph.pick(_bf16(8 * KIB)).name == SYMM_ONE_SHOT
    assert not choice.split_graph(2048 * KIB), "a 4 us win does not pay for splitting the graph"
    assert not choice.split_graph(4096 * KIB)


def test_the_fused_forms_timings_are_kept_for_the_record_but_never_chosen_as_a_method():
    """The peer-memory kernel's fused (all-reduce + add + RMSNorm) timing sits beside the methods' timings;
    it is not a method of its own, so a faster figure there must not turn into a pick (nor into NCCL)."""
    from shardserve.distributed.all_reduce import IPC_ONE_SHOT

    methods = [FakeMethod(NCCL), FakeMethod(IPC_ONE_SHOT, 512 * KIB)]
    timings = {
        f"{NCCL}/graph": {8 * KIB: 14.7, 64 * KIB: 16.0},
        f"{NCCL_EAGER_PIECES}/eager": {8 * KIB: 50.0, 64 * KIB: 52.0},
        f"{IPC_ONE_SHOT}/graph": {8 * KIB: 4.4, 64 * KIB: 6.0},
        f"{IPC_ONE_SHOT}/eager": {8 * KIB: 43.0, 64 * KIB: 45.0},
        f"{IPC_ONE_SHOT}+norm/graph": {8 * KIB: 1.0, 64 * KIB: 1.0},
    }
    choice = _choose(methods, timings, [8 * KIB, 64 * KIB], forced=None)
    assert choice.graph.pick(_bf16(8 * KIB)).name == IPC_ONE_SHOT
    assert choice.graph.pick(_bf16(64 * KIB)).name == IPC_ONE_SHOT
    assert choice.eager.pick(_bf16(8 * KIB)).name == IPC_ONE_SHOT
    assert "+norm" not in choice.describe()


def test_the_peer_memory_slots_hold_the_decode_graphs_largest_message_but_not_a_prefill_chunk():
    """Llama-3-8B's rows are 8 KiB in bf16: decode graphs of up to 512 sequences send up to 4 MiB, a prefill chunk
    of 8192 tokens 64 MiB (NCCL's: past the slots' cap). A 2048-wide model's 8 MiB message of 4096 rows is past
    the kernel's row limit, so it does not size the slots either."""
    from shardserve.distributed.all_reduce import SYMM_MAX_BYTES, peer_slot_bytes
    from shardserve.engine.cuda_graphs import graph_buckets

    row = 4096 * 2
    decode = [b * row for b in graph_buckets(512)]
    assert peer_slot_bytes([*decode, 8192 * row], row) == 512 * row == 4 * 2**20
    assert peer_slot_bytes([b * row for b in graph_buckets(64)] + [2048 * row], row) == SYMM_MAX_BYTES
    assert peer_slot_bytes([1024 * 4096, 4096 * 4096], 2048 * 2) == 1024 * 4096
