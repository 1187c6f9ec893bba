"""The peer-memory one-shot all-reduce (and its fused residual add + RMSNorm) on two GPUs: sums equal to the
rank-ordered float32 sum bit for bit, on every rank, eagerly and replayed from CUDA graphs; and the peer-memory
broadcast of rank 0's sampled tokens, eagerly and inside a graph (and, on CPU ranks, its fallback)."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import run_ranks

# Up to the slots' 512 KiB in float32; up to 128 KiB the low-latency form (16-bit rows of an even width).
SHAPES = ((1, 4096), (3, 4096), (32, 4096), (5, 1000), (2, 1001))
# Slots of 4 MiB (a decode graph of 512 sequences of 4096 bf16 values): up to 1024 rows, each on its own flag.
LARGE_SLOT = 4 * 2**20
LARGE_SHAPES = ((512, 4096), (1024, 2048), (300, 1001), (1, 4096))


def _on_rank(rank: int, port: int, device: str, check, results) -> None:
    """One rank of a two-rank group on `device`: check(rank, ctx), reported as "ok" or the error."""
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context

    ctx = init_rank_context(rank, 2, device, f"tcp://127.0.0.1:{port}", control_token=f"{check.__name__}-test")
    try:
        check(rank, ctx)
        results.put((rank, "ok"))
    except Exception as e:  # noqa: BLE001 - the test reports it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx)


def _on_two_gpus(check) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    assert run_ranks(_on_rank, 2, "cuda", check, timeout=300) == {0: "ok", 1: "ok"}


def _check_sums(rank: int, ctx) -> None:
    import torch.distributed as dist

    from shardserve.distributed.all_reduce import SYMM_MAX_BYTES, IpcOneShotAllReduce
    from shardserve.kernels.triton.fused_ops import fused_add_rms_norm

    cases = [(dtype, SYMM_MAX_BYTES, SHAPES) for dtype in (torch.bfloat16, torch.float32)]
    cases.append((torch.bfloat16, LARGE_SLOT, LARGE_SHAPES))
    for dtype, slot_bytes, shapes in cases:
        method = IpcOneShotAllReduce(ctx.control_group, rank, 2, ctx.device, dtype, slot_bytes)
        for rows, cols in shapes:
            g = torch.Generator(ctx.device).manual_seed(rows * cols + rank)
            x = torch.randn(rows, cols, generator=g, device=ctx.device).to(dtype)
            parts = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(parts, x, group=ctx.comm.group)
            expected = (parts[0].float() + parts[1].float()).to(dtype)
            assert torch.equal(method(x.clone()), expected), f"sum {dtype} {rows}x{cols}"
            residual = torch.randn(rows, cols, generator=g, device=ctx.device).to(dtype)
            dist.broadcast(residual, 0, group=ctx.comm.group)  # replicated, as in the model
            weight = (1 + torch.rand(cols, generator=g, device=ctx.device)).to(dtype)
            dist.broadcast(weight, 0, group=ctx.comm.group)
            normed, summed = method.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
            ref_normed, ref_summed = fused_add_rms_norm(expected.clone(), residual.clone(), weight, 1e-5)
            assert torch.equal(summed, ref_summed), f"residual {dtype} {rows}x{cols}"
            assert torch.equal(normed, ref_normed), f"norm {dtype} {rows}x{cols}"
        # In a CUDA graph: several calls per replay (the slots alternate), replayed with new inputs.
        static = [torch.zeros(2, 4096, dtype=dtype, device=ctx.device) for _ in range(5)]
        graph = torch.cuda.CUDAGraph()
        method.begin_capture()
        with torch.cuda.graph(graph):
            outs = [method(s) for s in static]
        method.end_capture()
        for replay in range(4):
            inputs = [torch.full_like(s, float(i + replay + rank)) for i, s in enumerate(static)]
            for s, v in zip(static, inputs):
                s.copy_(v)
            graph.replay()
            method(torch.ones(1, 4096, dtype=dtype, device=ctx.device))  # an eager call between replays
            for i, out in enumerate(outs):
                assert torch.equal(out, torch.full_like(out, float(2 * (i + replay) + 1))), f"replay {replay}"
        torch.cuda.synchronize()
        method.close()


@pytest.mark.gpu
def test_peer_memory_all_reduce_matches_the_rank_ordered_sum_on_two_gpus():
    _on_two_gpus(_check_sums)


def _check_gemv_add(rank: int, ctx) -> None:
    """The row-parallel GEMV with the all-reduce, residual add and norm in its launch: the residual each rank gets
    equals the plain GEMV then the unfused all-reduce with the add, bit for bit, and the normed output its norm
    (to the last bit: the sum of squares is reduced in another order); eagerly and replayed from a CUDA graph in
    which it alternates with unfused calls (sharing their slots and epochs)."""
    import torch.distributed as dist

    from shardserve.distributed.all_reduce import SYMM_MAX_BYTES, IpcOneShotAllReduce
    from shardserve.kernels.triton.gemv import gemv, gemv_swiglu

    dtype = torch.bfloat16
    method = IpcOneShotAllReduce(ctx.control_group, rank, 2, ctx.device, dtype, SYMM_MAX_BYTES)
    g = torch.Generator(ctx.device).manual_seed(7 + rank)
    for (n, k), config in (((4096, 2048), (8, 512, 4, 1)), ((4096, 7168), (4, 1024, 8, 4)),
                           ((1000, 300), (8, 256, 4, 3))):
        for swiglu in (False, True):
            w = torch.randn(n, k, generator=g, device=ctx.device).to(dtype) / k ** 0.5
            x = torch.randn(1, (2 if swiglu else 1) * k, generator=g, device=ctx.device).to(dtype)
            residual = torch.randn(1, n, generator=g, device=ctx.device).to(dtype)
            dist.broadcast(residual, 0, group=ctx.comm.group)  # replicated, as in the model
            norm_weight = (1 + torch.rand(n, generator=g, device=ctx.device)).to(dtype)
            dist.broadcast(norm_weight, 0, group=ctx.comm.group)
            part = (gemv_swiglu if swiglu else gemv)(x, w, *config)
            expected_normed, expected = method.add_rms_norm(part, residual.clone(), norm_weight, 1e-5)
            assert method.takes_gemv(residual, config[0])
            normed, summed = method.gemv_add(x, w, residual.clone(), norm_weight, 1e-5, swiglu, config)
            assert torch.equal(summed, expected), f"{n}x{k} swiglu={swiglu}"
            torch.testing.assert_close(normed, expected_normed, atol=0, rtol=1e-2)
    # In a graph: fused and unfused calls alternating over the slots, replayed with new inputs.
    w = torch.randn(4096, 2048, generator=g, device=ctx.device).to(dtype) / 45
    x = torch.zeros(1, 2048, dtype=dtype, device=ctx.device)
    residuals = [torch.zeros(1, 4096, dtype=dtype, device=ctx.device) for _ in range(3)]
    plains = [torch.zeros(1, 4096, dtype=dtype, device=ctx.device) for _ in residuals]
    graph = torch.cuda.CUDAGraph()
    method.begin_capture()
    with torch.cuda.graph(graph):
        for r, p in zip(residuals, plains):
            method.gemv_add(x, w, r, torch.ones(4096, dtype=dtype, device=ctx.device), 1e-5, False, (8, 512, 4, 1))
            method(p)
    method.end_capture()
    for replay in range(4):
        x.copy_(torch.randn(1, 2048, generator=g, device=ctx.device).to(dtype))
        starts = [torch.randn(1, 4096, generator=g, device=ctx.device).to(dtype) for _ in residuals]
        for r, s in zip(residuals, starts):
            dist.broadcast(s, 0, group=ctx.comm.group)
            r.copy_(s)
        for p in plains:
            p.fill_(float(rank + replay))
        graph.replay()
        part = gemv(x, w, 8, 512, 4, 1)
        parts = [torch.empty_like(part) for _ in range(2)]
        dist.all_gather(parts, part, group=ctx.comm.group)
        total = (parts[0].float() + parts[1].float()).to(dtype)
        for r, s in zip(residuals, starts):
            assert torch.equal(r, (total.float() + s.float()).to(dtype)), f"replay {replay}"
        for p in plains:
            assert torch.equal(p, torch.full_like(p, float(2 * replay + 1))), f"replay {replay}"
    torch.cuda.synchronize()
    del graph
    method.close()


@pytest.mark.gpu
def test_a_gemv_with_the_all_reduce_and_residual_add_inside_matches_the_separate_kernels_on_two_gpus():
    _on_two_gpus(_check_gemv_add)


def _check_broadcast(rank: int, ctx) -> None:
    import torch.distributed as dist

    from shardserve.distributed import token_broadcast

    tokens = token_broadcast.build(ctx.comm.group, ctx.control_group, rank, 2, ctx.device, max_rows=64)
    assert tokens is not None, "the peer-memory token broadcast was not set up"
    for n in (1, 7, 64, 3):
        sent = torch.arange(n, device=ctx.device) * 1009 + n
        x = sent.clone() if rank == 0 else torch.full_like(sent, -1)
        tokens(x)
        assert torch.equal(x, sent), f"eager {n}: {x.tolist()}"
        dist.barrier(group=ctx.comm.group)  # the collective between two calls that the kernel relies on
    # In a CUDA graph, as the decode graphs use it: only rank 0 writes the static buffer before a replay.
    static = torch.zeros(16, dtype=torch.long, device=ctx.device)
    total = torch.zeros(1, device=ctx.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens(static)
        total.copy_(static.sum().float().view(1))
        dist.all_reduce(total, group=ctx.comm.group)
    for replay in range(5):
        sent = torch.arange(16, device=ctx.device) * (replay + 3) + replay
        if rank == 0:
            static.copy_(sent)
        graph.replay()
        assert torch.equal(static, sent), f"replay {replay}: {static.tolist()}"
        assert float(total) == 2 * float(sent.sum()), f"replay {replay}: sum {float(total)}"
    torch.cuda.synchronize()
    del graph
    tokens.close()


@pytest.mark.gpu
def test_peer_memory_token_broadcast_delivers_rank_zeros_ids_eagerly_and_in_graphs():
    _on_two_gpus(_check_broadcast)


def _check_broadcast_falls_back(rank: int, ctx) -> None:
    from shardserve.distributed import token_broadcast

    assert token_broadcast.build(ctx.comm.group, ctx.control_group, rank, 2, ctx.device, max_rows=8) is None
    assert ctx.comm.tokens is None
    sent = torch.tensor([3, 1, 2**31 - 1])
    x = sent.clone() if rank == 0 else torch.full_like(sent, -1)
    ctx.comm.broadcast_from_first(x)  # the process group's own broadcast
    assert torch.equal(x, sent), x.tolist()


def test_without_peer_memory_every_rank_keeps_the_process_groups_broadcast():
    """CPU ranks (no CUDA IPC): setting up the peer-memory broadcast fails on every rank alike, start-up goes on,
    and the communicator still delivers rank 0's tokens."""
    assert run_ranks(_on_rank, 2, "cpu", _check_broadcast_falls_back, timeout=120) == {0: "ok", 1: "ok"}
