"""Batches through packed layers (layers/quantization/gemm_choice.py): per bucket of row counts, the fused GEMM where
start-up timing chose it, else dequantize + cuBLAS. The choice is rank 0's on every rank, and checked against float64 once
applied; a GEMM that fails that check anywhere sends every rank's batches back to dequantizing.

Without CUDA the timing cannot run (it is CUDA-graph timing): the choice is given, and the GEMM runs in Triton's
interpreter. On CUDA (-m gpu) the timing runs on Llama-3-8B-sized layers."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from torch import nn

from shardserve.distributed.process_group import single_rank_context
from shardserve.engine import kernel_setup
from shardserve.layers.quantization import gemm_choice as packed_batches
from shardserve.layers.quantization.check import check_packed
from shardserve.layers.quantization.packed import batch_bucket, BATCH_BUCKETS, BATCH_LIMITS, PackedLayout, PackedWeights
from tests.helpers.kernels import packed_layer
from tests.ranks import run_ranks

CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
TILES = (16, 32, 64, 4, 1)


def test_timing_and_check_rows_fall_in_their_own_buckets():
    assert BATCH_BUCKETS == len(packed_batches.TIMING_ROWS) == len(packed_batches.CHECK_ROWS)
    for bucket, (timed, checked) in enumerate(zip(packed_batches.TIMING_ROWS, packed_batches.CHECK_ROWS)):
        assert batch_bucket(timed) == batch_bucket(checked) == bucket
    assert [batch_bucket(limit) for limit in BATCH_LIMITS] == list(range(len(BATCH_LIMITS)))
    assert batch_bucket(BATCH_LIMITS[-1] + 1) == BATCH_BUCKETS - 1


def test_layers_dequantize_batches_until_a_gemm_is_chosen_for_their_shape():
    model = nn.Sequential(packed_layer(40, 256, PackedLayout("int4", 64), torch.float16),
                          packed_layer(48, 256, PackedLayout("int4", 64), torch.float16))
    assert all(layer.packed.batch_gemms == (None,) * BATCH_BUCKETS for layer in model)
    assert packed_batches.gemm_check_rows(model) == ()
    choice = [None, list(TILES), None, None, None, TILES]  # 17 to 64 rows, and past 1024
    packed_batches.use_batch_kernels(model, {model[0].packed.config_key(model[0]): choice})
    assert model[0].packed.batch_gemms == (None, TILES, None, None, None, TILES)
    assert model[1].packed.batch_gemms == (None,) * BATCH_BUCKETS
    assert model[0].packed.batch_gemm(torch.zeros(17, 256, dtype=torch.float16)) == TILES
    assert model[0].packed.batch_gemm(torch.zeros(16, 256, dtype=torch.float16)) is None
    assert model[0].packed.batch_gemm(torch.zeros(17, 256)) is None  # float32 activations never take it
    assert packed_batches.gemm_check_rows(model) == (40, 1500)
    assert packed_batches.summary(model) == \
        f"batches through the fused GEMM in 2 of {2 * BATCH_BUCKETS} (shape, rows) buckets"


def test_a_choice_for_another_number_of_buckets_is_refused():
    model = nn.Sequential(packed_layer(40, 256, PackedLayout("int4", 64), torch.float16))
    with pytest.raises(ValueError, match=f"name 2 buckets, not {BATCH_BUCKETS}: every rank must run the same"):
        packed_batches.use_batch_kernels(model, {model[0].packed.config_key(model[0]): [None, None]})


def test_float32_layers_and_fp8_on_scaled_mm_never_take_the_gemm():
    assert not packed_layer(40, 256, PackedLayout("int4", 64), torch.float32).packed.takes_gemm()
    assert packed_layer(40, 256, PackedLayout("fp8", 128), torch.bfloat16).packed.takes_gemm()
    model = nn.Sequential(packed_layer(40, 256, PackedLayout("int4", 64), torch.float32))
    assert packed_batches.summary(model) == ""


@needs_triton
@pytest.mark.skipif(CUDA, reason="CPU: no timing; the GPU test below times")
@pytest.mark.usefixtures("bfloat16_dot_in_the_interpreter")
def test_a_chosen_gemm_is_checked_and_a_wrong_one_dropped(monkeypatch, caplog):
    model = nn.Sequential(packed_layer(40, 256, PackedLayout("int4", 64), torch.bfloat16))
    choice = {model[0].packed.config_key(model[0]): [list(TILES), list(TILES)] + [None] * (BATCH_BUCKETS - 2)}
    monkeypatch.setattr(packed_batches, "time_batch_kernels", lambda model: choice)
    ctx = single_rank_context("cpu")
    assert kernel_setup.choose_batch_kernels(model, ctx) == \
        f"batches through the fused GEMM in 2 of {BATCH_BUCKETS} (shape, rows) buckets"
    assert model[0].packed.batch_gemms[:2] == (TILES, TILES)

    monkeypatch.setattr(PackedWeights, "_gemm", lambda self, layer, x, config: 2 * self._dequantized_product(layer, x))
    with caplog.at_level(logging.WARNING):
        assert kernel_setup.choose_batch_kernels(model, ctx) == "batches dequantized (the fused GEMM failed its check)"
    assert model[0].packed.batch_gemms == (None,) * BATCH_BUCKETS
    assert "fused GEMM failed its start-up check" in caplog.text and "40x256 at 5 rows" in caplog.text


@needs_triton
@pytest.mark.skipif(CUDA, reason="CPU: the timer is faked; the GPU test below times")
def test_timing_keeps_the_gemm_only_where_faster_and_skips_tiles_that_compute_wrong(monkeypatch):
    """Two candidate tiles, the first computing wrong; a fake timer where the GEMM wins every bucket but the third,
    and the last (4096 rows) runs out of memory: the right tiles where the GEMM won, dequantizing elsewhere."""
    from shardserve.kernels.triton import quant_gemm
    from shardserve.layers import cuda_gemv

    wrong, right = (16, 32, 64, 4, 1), (16, 16, 64, 4, 1)
    model = nn.Sequential(*[packed_layer(40, 256, PackedLayout("int4", 64), torch.float16, seed=i) for i in range(2)])
    gemm = PackedWeights._gemm

    def gemm_wrong_for_one_tile(self, layer, x, config):
        return gemm(self, layer, x, right) * (2 if tuple(config) == wrong else 1)

    def fake_timer(fn, layers, x, replays=10):
        if x.shape[0] == packed_batches.TIMING_ROWS[-1]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        dense = "_dequantized_product" in fn.__code__.co_names
        return (10.0 if dense else 5.0) if x.shape[0] != packed_batches.TIMING_ROWS[2] else (5.0 if dense else 10.0)

    monkeypatch.setattr(packed_batches, "TIMING_ROWS", (16, 64, 20, 25, 30, 4096))  # interpreter-sized batches
    monkeypatch.setattr(quant_gemm, "candidate_configs", lambda m: (wrong, right))
    monkeypatch.setattr(PackedWeights, "_gemm", gemm_wrong_for_one_tile)
    monkeypatch.setattr(cuda_gemv, "time_in_graph_us", fake_timer)
    monkeypatch.setattr(nn.Parameter, "is_cuda", property(lambda self: True))  # time these CPU layers
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    chosen = packed_batches.time_batch_kernels(model)
    assert chosen == {model[0].packed.config_key(model[0]): [list(right), list(right), None, list(right), list(right), None]}


def _two_ranks_choose(rank: int, port: int, results) -> None:
    """Rank 0 times tiles for the first bucket, rank 1 would dequantize; then rank 1's GEMM computes wrong."""
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context

    torch.set_num_threads(1)
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", control_token="t" * 64)
    try:
        model = nn.Sequential(packed_layer(40, 256, PackedLayout("int4", 64), torch.float16))
        mine = [list(TILES) if rank == 0 else None] + [None] * (BATCH_BUCKETS - 1)
        packed_batches.time_batch_kernels = lambda model: {model[0].packed.config_key(model[0]): mine}
        first = kernel_setup.choose_batch_kernels(model, ctx), model[0].packed.batch_gemms[0]
        if rank == 1:
            PackedWeights._gemm = lambda self, layer, x, config: torch.zeros(x.shape[0], self.n, dtype=x.dtype)
        second = kernel_setup.choose_batch_kernels(model, ctx), model[0].packed.batch_gemms[0]
        results.put((rank, (first, second)))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx)


@needs_triton
@pytest.mark.skipif(CUDA, reason="CPU ranks (gloo) with the interpreter")
def test_every_rank_uses_rank_0s_choice_and_drops_it_when_any_rank_fails_the_check():
    outcome = run_ranks(_two_ranks_choose, 2)
    for rank in (0, 1):
        assert not isinstance(outcome[rank], str), outcome[rank]
        (first, tiles), (second, after) = outcome[rank]
        assert tiles == TILES and first.startswith(f"batches through the fused GEMM in 1 of {BATCH_BUCKETS}"), rank
        assert after is None and second == "batches dequantized (the fused GEMM failed its check)", rank


# -- CUDA: the timing itself -------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="CUDA-graph timing")
@pytest.mark.parametrize("layout", [PackedLayout("int4", 128), PackedLayout("int4", 0), PackedLayout("fp8", 128)],
                         ids=PackedLayout.describe)
def test_gpu_timing_chooses_per_bucket_and_the_choice_passes_the_check(layout):
    model = nn.Sequential(*[packed_layer(4096, 4096, layout, torch.bfloat16, seed=i) for i in range(4)])
    chosen = packed_batches.time_batch_kernels(model)
    configs = chosen[model[0].packed.config_key(model[0])]
    assert len(chosen) == 1 and len(configs) == BATCH_BUCKETS
    assert all(c is None or len(c) == 5 for c in configs)
    packed_batches.use_batch_kernels(model, chosen)
    rows = packed_batches.gemm_check_rows(model)
    assert check_packed(model, (1, 5) + rows) == []
