"""Packed quantized layers (layers/quantization/packed.py and its formats) against float64 on their own packed values:
every product path (the single-row Triton GEMVs, torch._scaled_mm for FP8 batches, the fused GEMM, dequantize +
matmul) from 1 to 512 rows, on Llama-3-8B's projections at TP 1 and 2 and a slice narrower than any kernel tile. On
CPU, the dequantizing path on small shapes and the fused GEMM in Triton's interpreter; the start-up check catches a
corrupted scale."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from shardserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.layers.quantization.check import check_packed, FP8_ACTIVATION_TOLERANCE, reference_weight
from shardserve.layers.quantization.packed import BATCH_LIMITS, PackedLayout, PackedWeights
from shardserve.kernels.self_check import TOLERANCE, relative_error
from tests.helpers.kernels import packed_layer

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
LAYOUTS = [PackedLayout("fp8", 0), PackedLayout("fp8", 128), PackedLayout("int4", 128), PackedLayout("int4", 32),
           PackedLayout("int4", 0)]
# (N, K): Llama-3-8B's qkv, o, gate_up and down projections at TP 1, then at TP 2; then a 24-row, 256-column slice.
GPU_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 4096), (4096, 2048), (14336, 4096),
              (4096, 7168), (24, 256)]
CPU_SHAPES = [(48, 256), (24, 256)]


def check_rows(layer, rows, dtype) -> None:
    w64 = reference_weight(layer)
    for m in rows:
        x = torch.randn(m, layer.packed.k, device=DEVICE).to(dtype)
        tolerance = TOLERANCE[dtype]
        if m > 1 and layer.packed.rowwise_fp8(x):
            tolerance = FP8_ACTIVATION_TOLERANCE
        error = relative_error(layer(x), (x.double() @ w64.T).cpu())
        assert error < tolerance, f"{layer.packed.layout.describe()} {tuple(layer.weight.shape)} at {m} rows: {error}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=PackedLayout.describe)
@pytest.mark.parametrize("shape", GPU_SHAPES if CUDA else CPU_SHAPES, ids=str)
def test_packed_products_match_float64_from_one_to_512_rows(layout, shape):
    dtype = torch.bfloat16 if CUDA else torch.float32
    check_rows(packed_layer(*shape, layout, dtype), (1, 2, 7, 64, 512) if CUDA else (1, 3), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="float16 activations: the GPU kernels")
@pytest.mark.parametrize("layout", LAYOUTS, ids=PackedLayout.describe)
def test_float16_activations(layout):
    check_rows(packed_layer(4096, 4096, layout, torch.float16), (1, 16), torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
@pytest.mark.parametrize("layout", LAYOUTS, ids=PackedLayout.describe)
def test_products_replay_in_a_cuda_graph(layout):
    assert_replays_in_a_cuda_graph(packed_layer(4096, 4096, layout, torch.bfloat16), (1, 8))


def assert_replays_in_a_cuda_graph(layer, rows) -> None:
    """A graph captured at each batch size of `rows`, replayed on a new input, gives the eager product."""
    for m in rows:
        x = torch.randn(m, layer.packed.k, device=DEVICE, dtype=torch.bfloat16)
        layer(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, layer(x))


# Layouts whose batches can take the fused GEMM (FP8 with one scale a row takes torch._scaled_mm on CUDA).
GEMM_LAYOUTS = [PackedLayout("int4", 128), PackedLayout("int4", 32), PackedLayout("int4", 0), PackedLayout("fp8", 128)]


def with_gemm(layer: nn.Module, tiles=None) -> nn.Module:
    """The layer with every bucket of batches on the fused GEMM: `tiles`, or each bucket's default tiles."""
    from shardserve.kernels.triton.quant_gemm import default_config

    largest = BATCH_LIMITS + (BATCH_LIMITS[-1] + 1,)  # a batch size in each bucket
    layer.packed.batch_gemms = tuple(tuple(tiles or default_config(rows)) for rows in largest)
    return layer


@needs_triton
@pytest.mark.usefixtures("bfloat16_dot_in_the_interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", GEMM_LAYOUTS + ([] if CUDA else [PackedLayout("fp8", 0)]), ids=PackedLayout.describe)
def test_batches_through_the_fused_gemm_match_float64(layout, dtype):
    """On CPU in Triton's interpreter with small tiles; on CUDA on Llama-3-8B's shapes with each bucket's default
    tiles, from 2 to 512 rows."""
    if not CUDA:
        check_rows(with_gemm(packed_layer(40, 256, layout, dtype), (16, 32, 64, 4, 1)), (3, 17), dtype)
        return
    for shape in GPU_SHAPES:
        check_rows(with_gemm(packed_layer(*shape, layout, dtype)), (2, 7, 17, 64, 100, 512), dtype)


@needs_triton
@pytest.mark.usefixtures("bfloat16_dot_in_the_interpreter")
def test_an_act_order_layer_gathers_its_input_before_the_fused_gemm():
    layer = packed_layer(40, 256, PackedLayout("int4", 64, act_order=True), torch.bfloat16)
    layer.input_perm.data.copy_(torch.randperm(256, generator=torch.Generator().manual_seed(0)))
    with_gemm(layer, None if CUDA else (16, 32, 64, 4, 1))
    assert check_packed(nn.Sequential(layer), (5, 40)) == []
    x = torch.randn(17, 256, device=DEVICE).to(torch.bfloat16)
    want = x.double()[:, layer.input_perm] @ reference_weight(layer).T
    assert relative_error(layer(x), want.cpu()) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
@pytest.mark.parametrize("layout", GEMM_LAYOUTS, ids=PackedLayout.describe)
def test_the_fused_gemm_replays_in_a_cuda_graph(layout):
    assert_replays_in_a_cuda_graph(with_gemm(packed_layer(4096, 4096, layout, torch.bfloat16)), (8, 200))


def test_a_row_parallel_slice_loads_its_own_columns_and_scales():
    """A row-parallel layer at rank 1 of 2 takes columns [128, 256) of the checkpoint and their groups' scales."""
    weights = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    whole = ColumnParallelLinear(256, {None: (0, 32)}, False, torch.float32)
    whole.packed = PackedWeights(whole, PackedLayout("int4", 64), "cpu")
    whole.weight.weight_loader(whole.weight, weights, None)
    half = RowParallelLinear((128, 256), 32, False, torch.float32, comm=None)
    half.packed = PackedWeights(half, PackedLayout("int4", 64), "cpu")
    half.weight.weight_loader(half.weight, weights, None)
    assert torch.equal(reference_weight(half), reference_weight(whole)[:, 128:])


def test_the_start_up_check_catches_a_kernel_that_drops_the_scales():
    model = nn.Sequential(packed_layer(48, 256, PackedLayout("fp8", 128), torch.bfloat16 if CUDA else torch.float32))
    assert check_packed(model) == []
    model[0].packed._product = lambda layer, x: x @ layer.weight.to(x.dtype).T  # FP8 values without their scales
    failures = check_packed(model)
    assert len(failures) == 2 and "48x256 at 1 rows" in failures[0] and "error" in failures[0]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="single-row products take the packed GEMVs on GPUs only")
@pytest.mark.parametrize("norm_fused", [False, True])
@pytest.mark.parametrize("kind", ["fp8", "int4-split"])
def test_a_packed_gate_up_layer_returns_swiglu_from_its_gemv_and_proves_it_at_start_up(kind, norm_fused):
    """An FP8 or 4-bit (split-K GEMV) [gate | up] projection's single-row product with SwiGLU inside: the bits of
    the product followed by the SwiGLU kernel (plain, and with the norm inside where norm-fused); the start-up
    check covers that form and names it when it is wrong."""
    from shardserve.kernels.triton.fused_ops import silu_and_mul
    from shardserve.layers.norm import RMSNorm

    layout = PackedLayout("fp8", 0) if kind == "fp8" else PackedLayout("int4", 128)
    layer = packed_layer(2 * 1024, 512, layout, torch.bfloat16)
    if kind == "int4-split":
        layer.packed.gemv_split = (64, 512, 4, 2)
    layer.makes_swiglu_output = True
    layer.packed.norm_fused = norm_fused
    x = torch.randn(1, 512, device=DEVICE).to(torch.bfloat16)
    y, activated = layer.forward_swiglu(x)
    assert activated and torch.equal(y, silu_and_mul(layer(x)))
    norm = RMSNorm(512, 1e-5, torch.bfloat16).to(DEVICE)
    y, summed, activated = layer.forward_normed_swiglu(x.clone(), x.clone(), norm)  # the norm module: in place
    product, summed_apart = layer.forward_normed(x.clone(), x.clone(), norm)
    assert activated and torch.equal(y, silu_and_mul(product)) and torch.equal(summed, summed_apart)
    model = nn.Sequential(layer)
    assert check_packed(model) == []
    layer.packed.swiglu_out = lambda layer, x: torch.zeros(1, 1024, dtype=x.dtype, device=x.device)
    failures = check_packed(model)
    assert len(failures) == 1 and "with SwiGLU out" in failures[0]


def test_an_act_order_layer_gathers_its_input_in_group_order():
    """An act-order layer's columns are sorted by group (input_perm): its product gathers the input the same way,
    and the start-up check passes it."""
    layer = packed_layer(48, 256, PackedLayout("int4", 128, act_order=True), torch.bfloat16 if CUDA else torch.float32)
    layer.input_perm.data.copy_(torch.randperm(256, generator=torch.Generator().manual_seed(0)))
    assert check_packed(nn.Sequential(layer)) == []
    x = torch.randn(3, 256, device=DEVICE).to(layer.packed.compute_dtype)
    want = x.double()[:, layer.input_perm] @ reference_weight(layer).T
    assert relative_error(layer(x), want.cpu()) < TOLERANCE[layer.packed.compute_dtype]


def test_fused_parts_in_different_act_orders_are_refused_naming_the_way_out():
    """q, k and v share one input, so one column order: parts sorted differently stop loading with the setting that
    serves the checkpoint dequantized."""
    from shardserve.weights.quantized import GptqWeight, QuantScheme

    def gptq_part(seed: int) -> GptqWeight:
        g = torch.Generator().manual_seed(seed)
        g_idx = torch.randperm(256, generator=g) // 128
        return GptqWeight("part", torch.randint(0, 2**31 - 1, (32, 16), generator=g, dtype=torch.int32),
                          torch.zeros(2, 2, dtype=torch.int32), torch.rand(2, 16), g_idx,
                          QuantScheme("gptq", group_size=128, act_order=True))

    layer = ColumnParallelLinear(256, {"q": (0, 16), "k": (0, 16)}, False, torch.float32)
    layer.packed = PackedWeights(layer, PackedLayout("int4", 128, act_order=True), "cpu")
    layer.weight.weight_loader(layer.weight, gptq_part(1), "q")
    with pytest.raises(ValueError, match="SHARDSERVE_QUANTIZED_LAYERS=dequantized"):
        layer.weight.weight_loader(layer.weight, gptq_part(2), "k")


def test_an_unknown_quantized_layers_mode_names_the_accepted_ones(set_env):
    from shardserve.layers.quantization.packed import quantized_layers_mode

    set_env(SHARDSERVE_QUANTIZED_LAYERS="packd")
    with pytest.raises(ValueError, match="SHARDSERVE_QUANTIZED_LAYERS='packd': expected one of auto, packed, "
                                         "dequantized"):
        quantized_layers_mode()


def test_an_unknown_fp8_matmul_kernel_names_the_accepted_ones(set_env):
    from shardserve.layers.quantization.packed import fp8_matmul_kernel

    set_env(SHARDSERVE_FP8_MATMUL="scaledmm")
    with pytest.raises(ValueError, match="SHARDSERVE_FP8_MATMUL='scaledmm': expected one of scaled_mm, triton"):
        fp8_matmul_kernel()
    set_env(SHARDSERVE_FP8_MATMUL="triton")
    assert fp8_matmul_kernel() == "triton"


@needs_triton
@pytest.mark.parametrize("layout", [PackedLayout("fp8", 0), PackedLayout("fp8", 128), PackedLayout("int4", 128)],
                         ids=PackedLayout.describe)
def test_the_norm_inside_the_single_row_gemv_equals_the_norm_then_the_product(layout, monkeypatch):
    """Where start-up timing chose it (the plain-data choice rank 0 shares), a packed layer's normed one-row input
    runs the norm inside its GEMV: the same residual sum bit for bit and the same product to the dtype's
    tolerance; the start-up check catches a fused kernel that drops the norm's weight."""
    from shardserve.layers.norm import RMSNorm
    from shardserve.layers.quantization.base import DEFAULT_GEMV
    from shardserve.layers.quantization.gemv_choice import NORM_FUSED_SUFFIX, use_gemv_configs

    dtype = torch.bfloat16 if CUDA else torch.float32
    n, k = (6144, 4096) if CUDA else (48, 256)
    layer = packed_layer(n, k, layout, dtype)
    model = nn.Sequential(layer)
    norm = RMSNorm(k, 1e-5, dtype).to(DEVICE)
    g = torch.Generator().manual_seed(4)
    norm.weight.data.copy_(torch.rand(k, generator=g).add_(0.5))
    x, residual = (torch.randn(1, k, generator=g).to(DEVICE, dtype) for _ in range(2))
    want, want_sum = layer.forward_normed(x.clone(), residual.clone(), norm)

    use_gemv_configs(model, {layer.packed.config_key(layer): list(DEFAULT_GEMV),
                             layer.packed.config_key(layer) + NORM_FUSED_SUFFIX: [1]})
    assert layer.packed.norm_fused and layer.packed.normed(layer, x, residual.clone(), norm.weight, 1e-5) is not None
    got, got_sum = layer.forward_normed(x.clone(), residual.clone(), norm)
    assert torch.equal(got_sum, want_sum)
    assert relative_error(got, want.double().cpu()) < TOLERANCE[dtype]
    assert check_packed(model, rows=(1,)) == []

    fused = layer.packed.normed
    monkeypatch.setattr(layer.packed, "normed", lambda layer, x, residual, weight, eps: fused(
        layer, x, residual, torch.ones_like(weight), eps))
    failures = check_packed(model, rows=(1,))
    assert len(failures) == 1 and "with the norm before it" in failures[0]
    use_gemv_configs(model, {})
    assert not layer.packed.norm_fused


@needs_triton
def test_a_chosen_split_k_gemv_runs_the_one_row_products(monkeypatch):
    """Where start-up timing chose the 4-bit split-K GEMV for a shape (the key + SPLIT_SUFFIX rank 0 shares), the
    layer's one-row products run it, with the norm inside too where that was chosen, and match float64; the
    default puts the tiled GEMV back."""
    from shardserve.kernels.triton import quant_gemv
    from shardserve.layers.norm import RMSNorm
    from shardserve.layers.quantization.base import DEFAULT_GEMV
    from shardserve.layers.quantization.gemv_choice import NORM_FUSED_SUFFIX, SPLIT_SUFFIX, use_gemv_configs

    dtype = torch.bfloat16 if CUDA else torch.float32
    n, k = (6144, 4096) if CUDA else (48, 256)
    split = (64, 512, 4, 1) if CUDA else (16, 128, 4, 2)
    layer = packed_layer(n, k, PackedLayout("int4", 128), dtype)
    model, key = nn.Sequential(layer), layer.packed.config_key(layer)
    calls = []
    for name in ("int4_gemv_split", "int4_gemv_split_rmsnorm"):
        kernel = getattr(quant_gemv, name)
        monkeypatch.setattr(quant_gemv, name,
                            lambda *args, kernel=kernel, name=name, **kwargs: calls.append(name) or kernel(*args,
                                                                                                     **kwargs))

    use_gemv_configs(model, {key: list(DEFAULT_GEMV), key + SPLIT_SUFFIX: list(split), key + NORM_FUSED_SUFFIX: [1]})
    assert layer.packed.gemv_split == split and layer.packed.norm_fused
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    w64 = reference_weight(layer)
    assert relative_error(layer.packed._gemv(layer, x), (x.double() @ w64.T).cpu()) < TOLERANCE[dtype]
    norm = RMSNorm(k, 1e-5, dtype).to(DEVICE)
    residual = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    h, _ = norm(x.clone(), residual.clone())
    got, _ = layer.packed.normed(layer, x, residual, norm.weight, norm.eps)
    assert relative_error(got, (h.double() @ w64.T).cpu()) < TOLERANCE[dtype]
    assert calls == ["int4_gemv_split", "int4_gemv_split_rmsnorm"]
    if CUDA:
        assert check_packed(model, rows=(1,)) == []

    use_gemv_configs(model, {})
    assert layer.packed.gemv_split is None and not layer.packed.norm_fused


@needs_triton  # the 4-bit split-K forms come from kernels/triton/quant_gemv.py
def test_float16_sums_are_timed_for_fp8_with_one_scale_a_row_only(set_env):
    """By default FP8_F16_CANDIDATES (a fifth element: partial sums in float16 pairs) join the start-up candidates of
    FP8 weights scaled per row; SHARDSERVE_FP8_GEMV_SUMS=float32 or float16 keeps one kind; block-scaled FP8 and
    4-bit weights are timed in GEMV_CANDIDATES' forms whatever it says; a bad value is named."""
    from shardserve.layers.linear import ColumnParallelLinear
    from shardserve.layers.quantization.base import GEMV_CANDIDATES
    from shardserve.layers.quantization.fp8 import FP8_F16_CANDIDATES
    from shardserve.layers.quantization.gemv_choice import _candidate_forms
    from shardserve.layers.quantization.packed import PackedLayout, PackedWeights

    def tiled(layout):
        layer = ColumnParallelLinear(512, {None: (0, 256)}, False, torch.bfloat16)
        return [config for config, split in _candidate_forms(PackedWeights(layer, layout, "cpu")) if split is None]

    assert all(len(config) == 5 and config[4] for config in FP8_F16_CANDIDATES)
    for sums, want in ((None, GEMV_CANDIDATES + FP8_F16_CANDIDATES), ("auto", GEMV_CANDIDATES + FP8_F16_CANDIDATES),
                       ("float32", GEMV_CANDIDATES), ("float16", FP8_F16_CANDIDATES)):
        if sums is not None:
            set_env(SHARDSERVE_FP8_GEMV_SUMS=sums)
        assert tiled(PackedLayout("fp8", 0)) == list(want), sums
        assert tiled(PackedLayout("fp8", 128)) == list(GEMV_CANDIDATES)
        assert tiled(PackedLayout("int4", 128)) == list(GEMV_CANDIDATES)
    set_env(SHARDSERVE_FP8_GEMV_SUMS="half")
    with pytest.raises(ValueError, match="SHARDSERVE_FP8_GEMV_SUMS"):
        tiled(PackedLayout("fp8", 0))


@needs_triton  # the 4-bit split-K forms come from kernels/triton/quant_gemv.py
def test_four_bit_split_forms_are_timed_with_float32_and_float16_sums(set_env):
    """By default start-up times each split-K candidate with float32 sums and with float16 sums (a fifth element 1),
    the latter only where sub-tiles are 16 columns or more; SHARDSERVE_INT4_GEMV_SUMS=float32 or float16 keeps one
    kind; a bad value is named."""
    from shardserve.layers.linear import ColumnParallelLinear
    from shardserve.layers.quantization.int4 import INT4_SPLIT_CANDIDATES
    from shardserve.layers.quantization.packed import PackedLayout, PackedWeights

    def forms(k, group):
        packed = PackedWeights(ColumnParallelLinear(k, {None: (0, 256)}, False, torch.bfloat16),
                               PackedLayout("int4", group), "cpu")
        return packed.format.split_forms(packed)

    fitting = [c for c in INT4_SPLIT_CANDIDATES if c[1] <= 512]  # K = 512 takes splits of 512 columns or fewer
    assert forms(512, 128) == [f for c in fitting for f in (c, (*c, 1))]
    assert forms(512, 8) == fitting  # sub-tiles of one word: float32 sums only
    set_env(SHARDSERVE_INT4_GEMV_SUMS="float32")
    assert forms(512, 128) == fitting
    set_env(SHARDSERVE_INT4_GEMV_SUMS="float16")
    assert forms(512, 128) == [(*c, 1) for c in fitting]
    set_env(SHARDSERVE_INT4_GEMV_SUMS="half")
    with pytest.raises(ValueError, match="SHARDSERVE_INT4_GEMV_SUMS"):
        forms(512, 128)


def test_an_fp8_o_projection_times_only_forms_that_hold_its_rows(monkeypatch):
    """An FP8 layer whose GEMV is to load all its rows while attention runs (preloads_rows, on a GPU of that many
    SMs) is timed only in tiled forms whose first tile is the whole row block held by programs all placed at once;
    without such forms (a wider row) or without the flag, every form; a form outside them preloads nothing."""
    from shardserve.layers.linear import RowParallelLinear
    from shardserve.layers.quantization.base import GEMV_CANDIDATES
    from shardserve.layers.quantization.fp8 import FP8_F16_CANDIDATES
    from shardserve.layers.quantization.gemv_choice import _candidate_forms
    from shardserve.layers.quantization.packed import holds_rows_of, PackedLayout, PackedWeights

    def packed(n, k):
        layer = RowParallelLinear((0, k), n, False, torch.bfloat16, None)
        return PackedWeights(layer, PackedLayout("fp8", 0), "cpu")

    forms = _candidate_forms(packed(2048, 4096), 132)
    assert forms and all(config[1] >= 4096 and config[0] * config[1] <= 128 * config[2] * 32 for config, _ in forms)
    every = [(c, None) for c in GEMV_CANDIDATES + FP8_F16_CANDIDATES]  # float32 and float16 sums (one scale a row)
    assert _candidate_forms(packed(2048, 8192), 132) == every
    assert _candidate_forms(packed(2048, 4096), 0) == every
    weights = packed(2048, 4096)
    assert holds_rows_of(weights, forms[0][0], 132) and not holds_rows_of(weights, (8, 512, 4, 3), 132)
