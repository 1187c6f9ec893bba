"""The batch GEMMs over packed quantized weights (kernels/triton/quant_gemm.py) against the formulas of
shardserve.kernels.quant_pack evaluated in float64.

Without CUDA they run in Triton's interpreter on small shapes: rows 1, 3, 17 and 64 (ragged against the 16-row
tiles), 40 output features (ragged against 32), several scale groups along K. On CUDA (pytest -m gpu) they run
on Llama-3-8B's projections at TP 1 and 2 up to 512 rows (every candidate tile at one K, each batch size's default
tile at the others) and inside a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shardserve.kernels.quant_pack import pack_int4, pack_scale_zero  # noqa: E402
from shardserve.kernels.self_check import TOLERANCE  # noqa: E402
from tests.helpers.kernels import (LLAMA3_8B, fp8_reference, int4_reference, random_fp8,  # noqa: E402
                                   random_int4, relative_error)

CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
interpreter_only = pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs Llama-3-8B's (-m gpu)")
DTYPES = [torch.float16, torch.bfloat16]
ROWS = [1, 3, 17, 64]
N = 40  # two 32-wide tiles of output features, the second ragged
SMALL = (16, 32, 64, 4, 1)  # (block_m, block_n, block_k, num_warps, num_stages): several tiles each way
pytestmark = pytest.mark.usefixtures("bfloat16_dot_in_the_interpreter")


def activations(m: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator(device=device).manual_seed(seed), device=device).to(dtype)


def int4_case(n: int, k: int, group: int, device: str = "cpu", seed: int = 0):
    """(packed weight, scale-and-zero words, float64 [N, K] it encodes)."""
    q, scale_zero = random_int4(n, k, group, device=device, seed=seed)
    return pack_int4(q), scale_zero, int4_reference(q, scale_zero, group)


# -- the interpreter: small shapes ---------------------------------------------------------------------------


@needs_triton
@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [16, 32, 64, 128, 256], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("m", ROWS)
def test_interpreter_int4_gemm(m, group, dtype):
    """K = 256 is 16, 8, 4 or 2 groups, or one group a row (256: the scale applied after the sum); groups of 16 in
    tiles of 32 columns, each group with its own scale."""
    from shardserve.kernels.triton.quant_gemm import int4_gemm

    qweight, scale_zero, w64 = int4_case(N, 256, group, seed=group)
    x = activations(m, 256, dtype)
    got = int4_gemm(x, qweight, scale_zero, group, SMALL)
    assert got.shape == (m, N) and got.dtype == dtype
    assert relative_error(got, x.double() @ w64.T) < TOLERANCE[dtype]


@needs_triton
@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,group_k", [(384, 128), (320, 128), (200, 64), (256, 256)],
                         ids=["3-blocks", "short-last-block", "ragged-k", "per-row"])
@pytest.mark.parametrize("m", ROWS)
def test_interpreter_fp8_gemm(m, k, group_k, dtype):
    from shardserve.kernels.triton.quant_gemm import fp8_gemm

    weight, scale = random_fp8(N, k, group_k, seed=k)
    x = activations(m, k, dtype)
    got = fp8_gemm(x, weight, scale, group_k, SMALL)
    assert got.shape == (m, N) and got.dtype == dtype
    assert relative_error(got, x.double() @ fp8_reference(weight, scale, group_k).T) < TOLERANCE[dtype]


@needs_triton
@interpreter_only
@pytest.mark.parametrize("group_k", [128, 256], ids=["blocks", "per-row"])
def test_interpreter_fp8_gemm_from_bits(group_k, monkeypatch):
    """The path for GPUs without fp8 conversions (sm80): e4m3 bits decoded to value / 256, scales 256 times."""
    from shardserve.kernels.triton import quant_gemm

    monkeypatch.setattr(quant_gemm, "_native_fp8", lambda device: False)
    weight, scale = random_fp8(N, 256, group_k, seed=3)
    x = activations(17, 256, torch.float16)
    got = quant_gemm.fp8_gemm(x, weight, scale, group_k, SMALL)
    assert relative_error(got, x.double() @ fp8_reference(weight, scale, group_k).T) < TOLERANCE[torch.float16]


@needs_triton
@interpreter_only
@pytest.mark.parametrize("m", [3, 64, 150])
def test_interpreter_default_tiles_cover_every_output(m):
    """The default tiles for each bucket of rows (150 rows: 10 tiles of 16 with the config given, more than one
    band of GROUP_M tile rows), every output written."""
    from shardserve.kernels.triton.quant_gemm import int4_gemm

    qweight, scale_zero, w64 = int4_case(N, 256, 64)
    x = activations(m, 256, torch.float16)
    want = x.double() @ w64.T
    for config in (None, SMALL):
        got = int4_gemm(x, qweight, scale_zero, 64, config)
        assert relative_error(got, want) < TOLERANCE[torch.float16], config


@needs_triton
@interpreter_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreter_act_order_columns_gathered_first(dtype):
    """An act-order weight's columns are sorted by group: the product of the gathered input x[:, perm] with the
    packed weight is the product of x with the weight in the checkpoint's column order."""
    from shardserve.kernels.triton.quant_gemm import int4_gemm

    perm = torch.randperm(256, generator=torch.Generator().manual_seed(5))
    qweight, scale_zero, packed64 = int4_case(N, 256, 32, seed=5)
    checkpoint64 = torch.empty_like(packed64)
    checkpoint64[:, perm] = packed64
    x = activations(17, 256, dtype)
    got = int4_gemm(x.index_select(1, perm), qweight, scale_zero, 32, SMALL)
    assert relative_error(got, x.double() @ checkpoint64.T) < TOLERANCE[dtype]


@needs_triton
@interpreter_only
def test_interpreter_int4_gemm_applies_each_groups_scale_and_zero():
    """Zero points far from 0 and scales 1 to 64 times apart between groups: a kernel that dropped the zeros, or
    used one group's scale for every column, would be off by far more than the tolerance (shown below)."""
    from shardserve.kernels.triton.quant_gemm import int4_gemm

    q, _ = random_int4(N, 256, 64, seed=7)
    scale = (2.0 ** torch.arange(4).repeat(N, 1) * 1e-2).contiguous()
    zero = torch.full((N, 4), 8.0)
    x = activations(17, 256, torch.float16)
    got = int4_gemm(x, pack_int4(q), pack_scale_zero(scale, zero), 64, SMALL)
    right = x.double() @ int4_reference(q, pack_scale_zero(scale, zero), 64).T
    without_zeros = x.double() @ int4_reference(q, pack_scale_zero(scale, torch.zeros_like(zero)), 64).T
    one_scale = x.double() @ int4_reference(q, pack_scale_zero(scale[:, :1].repeat(1, 4), zero), 64).T
    assert relative_error(got, right) < TOLERANCE[torch.float16]
    assert relative_error(without_zeros, right) > 0.5 and relative_error(one_scale, right) > 0.5


@needs_triton
@interpreter_only
def test_interpreter_fp8_gemm_applies_each_blocks_scale():
    from shardserve.kernels.triton.quant_gemm import fp8_gemm

    weight, _ = random_fp8(N, 384, 128, seed=8)
    scale = (2.0 ** (3 * torch.arange(3)).repeat(N, 1) * 1e-3).contiguous()
    x = activations(17, 384, torch.float16)
    got = fp8_gemm(x, weight, scale, 128, SMALL)
    right = x.double() @ fp8_reference(weight, scale, 128).T
    one_scale = x.double() @ fp8_reference(weight, scale[:, :1].repeat(1, 3), 128).T
    assert relative_error(got, right) < TOLERANCE[torch.float16] and relative_error(one_scale, right) > 0.5


@needs_triton
@interpreter_only
def test_interpreter_block_k_narrows_to_the_group():
    """A 128-column tile over groups of 32 is narrowed to 32 columns, so each tile still needs one scale a row."""
    from shardserve.kernels.triton.quant_gemm import int4_gemm

    qweight, scale_zero, w64 = int4_case(N, 256, 32)
    x = activations(5, 256, torch.float16)
    got = int4_gemm(x, qweight, scale_zero, 32, (16, 32, 128, 4, 1))
    assert relative_error(got, x.double() @ w64.T) < TOLERANCE[torch.float16]


@needs_triton
def test_gemms_reject_what_they_cannot_compute_naming_it():
    from shardserve.kernels.triton.quant_gemm import fp8_gemm, int4_gemm

    device = "cuda" if CUDA else "cpu"
    qweight, scale_zero, _ = int4_case(8, 64, 32, device=device)
    with pytest.raises(ValueError, match=r"int4_gemm needs x of shape \[M, 64\] in bfloat16 or float16"):
        int4_gemm(torch.randn(2, 64, device=device), qweight, scale_zero, 32)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        int4_gemm(activations(2, 64, torch.float16, device), qweight, scale_zero, 32, (16, 24, 32, 4, 1))
    q, scale_zero8 = random_int4(8, 64, 8, device=device)
    with pytest.raises(ValueError, match="scale groups of a multiple of 16 columns, got 8"):
        int4_gemm(activations(2, 64, torch.float16, device), pack_int4(q), scale_zero8, 8)
    weight, fp8_scale = random_fp8(8, 64, 32, device=device)
    with pytest.raises(ValueError, match=r"fp8_gemm needs x of shape \[M, 64\]"):
        fp8_gemm(activations(2, 32, torch.float16, device), weight, fp8_scale, 32)
    assert int4_gemm(activations(0, 64, torch.float16, device), qweight, scale_zero, 32).shape == (0, 8)


def test_every_batch_size_has_candidate_tiles_default_first():
    pytest.importorskip("triton")
    from shardserve.kernels.triton.quant_gemm import candidate_configs, default_config

    for m in (1, 16, 17, 64, 65, 256, 257, 100_000):
        configs = candidate_configs(m)
        assert configs and default_config(m) == configs[0]
    assert default_config(16).block_m == 16 and default_config(17).block_m > 16


# -- CUDA: Llama-3-8B's shapes, every candidate tile -------------------------------------------------------------

GPU_ROWS = (2, 16, 17, 64, 100, 256, 512)
# K is a compile-time constant of both kernels, so each K compiles every tile again. Every candidate tile runs
# in both activation dtypes at one K (the down projection's, the longest); the other Ks run each batch size's
# default tile in bfloat16, enough to catch a K-dependent error without compiling the whole grid again.
EVERY_TILE_K = 14336


def _gpu_failures(run, w64: torch.Tensor, k: int, what: str) -> list[str]:
    """Failures of run(x, config) against x @ w64^T at GPU_ROWS rows: every candidate tile of each row count in
    bfloat16 and float16 where k is EVERY_TILE_K, the default tile in bfloat16 elsewhere."""
    from shardserve.kernels.triton.quant_gemm import candidate_configs

    every_tile = k == EVERY_TILE_K
    failures = []
    for dtype in DTYPES if every_tile else [torch.bfloat16]:
        for m in GPU_ROWS:
            x = activations(m, k, dtype, "cuda", seed=m)
            want = x.double() @ w64.T
            for config in candidate_configs(m) if every_tile else candidate_configs(m)[:1]:
                got = run(x, config)
                error = relative_error(got, want) if got.shape == want.shape else float("inf")
                if not (got.dtype == dtype and error < TOLERANCE[dtype]):
                    failures.append(f"{what} {dtype} at {m} rows, tiles {tuple(config)}: error {error:.2g}")
    return failures


def test_one_gpu_shape_runs_every_candidate_tile():
    assert EVERY_TILE_K in {k for _, k in LLAMA3_8B}


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("n,k", LLAMA3_8B, ids=str)
def test_gpu_int4_gemm(n, k):
    """Groups of 16 (tiles of 32 columns, two groups each: 16-column tiles gave wrong products on an H200), 32, 64
    and 128 and one group a row."""
    from shardserve.kernels.triton.quant_gemm import int4_gemm

    failures = []
    for group in (16, 32, 64, 128, k):
        qweight, scale_zero, w64 = int4_case(n, k, group, device="cuda", seed=group)
        run = lambda x, c: int4_gemm(x, qweight, scale_zero, group, c)  # noqa: E731
        failures += _gpu_failures(run, w64, k, f"int4 {n}x{k} group {group}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("native", [True, False], ids=["fp8", "fp8-bits"])
@pytest.mark.parametrize("n,k", LLAMA3_8B, ids=str)
def test_gpu_fp8_gemm(n, k, native, monkeypatch):
    """Blocks of 128 columns and one scale a row, with fp8 conversions and decoding e4m3 bits (as on sm80)."""
    from shardserve.kernels.triton import quant_gemm

    monkeypatch.setattr(quant_gemm, "_native_fp8", lambda device: native)
    failures = []
    for group_k in (128, k):
        weight, scale = random_fp8(n, k, group_k, device="cuda", seed=group_k)
        run = lambda x, c: quant_gemm.fp8_gemm(x, weight, scale, group_k, c)  # noqa: E731
        failures += _gpu_failures(run, fp8_reference(weight, scale, group_k), k, f"fp8 {n}x{k} group_k {group_k}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_gpu_gemms_replay_in_a_cuda_graph_with_a_new_input():
    from shardserve.kernels.triton.quant_gemm import fp8_gemm, int4_gemm

    qweight, scale_zero, _ = int4_case(4096, 4096, 128, device="cuda")
    weight, fp8_scale = random_fp8(4096, 4096, 128, device="cuda")
    launches = {"int4": lambda x: int4_gemm(x, qweight, scale_zero, 128),
                "fp8": lambda x: fp8_gemm(x, weight, fp8_scale, 128)}
    for name, launch in launches.items():
        for m in (8, 100):
            x = activations(m, 4096, torch.bfloat16, "cuda")
            launch(x)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = launch(x)
            new_x = activations(m, 4096, torch.bfloat16, "cuda", seed=2)
            x.copy_(new_x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, launch(new_x)), f"{name} at {m} rows"
