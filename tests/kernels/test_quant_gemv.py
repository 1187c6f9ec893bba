"""Quantized weights: the int4 packing round-trips, the dequantizers and the batch-1 GEMVs agree with the
formulas of shardserve.kernels.quant_pack evaluated in float64.

The packing and torch dequantizers run everywhere. Without CUDA the Triton kernels run in Triton's interpreter
on tiny CPU shapes (float32 and float16 inputs: the interpreter truncates rather than rounds to bfloat16); on
CUDA they run on Llama-3-8B's projections at TP 1 and 2 for every group size and several tile shapes, and
inside CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shardserve import envs  # noqa: E402
from shardserve.kernels.quant_pack import (dequantize_fp8, dequantize_int4, pack_int4,  # noqa: E402
                                           pack_scale_zero, unpack_int4_rows, unpack_scale_zero)
from shardserve.kernels.self_check import TOLERANCE  # noqa: E402
from tests.helpers.kernels import (LLAMA3_8B, fp8_reference, int4_reference, packed_layer,  # noqa: E402
                                   random_fp8, random_int4, relative_error, scale_and_zero)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
LM_HEAD = [(128256 // 2, 4096)]  # a GPTQ head with lm_head: true, one rank's vocabulary rows at TP 2
TINY = (24, 256)  # below one tile of rows (N % 8 != 0 for block_n 16) and of columns for block_k 512
# (block_n, block_k, num_warps, num_stages); block_k 1024 spans several groups, 256 is below a group of K.
CONFIGS = [(8, 512, 4, 1), (4, 1024, 8, 4), (16, 256, 4, 2)]


# -- the formulas, in float64, written from the layout's definition -------------------------------------------


# -- packing and dequantizing (plain torch, any device) --------------------------------------------------------


def test_pack_puts_even_columns_in_the_low_nibble_and_round_trips():
    assert pack_int4(torch.tensor([[1, 2, 15, 0]])).tolist() == [[0x21, 0x0F]]
    q = torch.randint(0, 16, (7, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = pack_int4(q.to(DEVICE))
    assert packed.dtype == torch.uint8 and packed.shape == (7, 48)
    assert torch.equal(unpack_int4_rows(packed).cpu(), q.to(torch.uint8))


@pytest.mark.parametrize("bad", [torch.tensor([[16, 0]]), torch.tensor([[-1, 0]]), torch.tensor([[1, 2, 3]]),
                                 torch.tensor([[1.0, 2.0]])])
def test_pack_rejects_what_does_not_fit_four_bits(bad):
    with pytest.raises(ValueError, match="pack_int4"):
        pack_int4(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(5, 256, 32), (3, 384, 128), (4, 96, 96)])
def test_dequantize_int4_is_the_formula_rounded_once(dtype, n, k, group):
    """(q - zero) * scale is exact in float64, so rounding it to float32 and then to dtype is the contract."""
    q, scale_zero = random_int4(n, k, group, device="cpu", seed=k)
    got = dequantize_int4(pack_int4(q), scale_zero, group, dtype)
    assert got.dtype == dtype and torch.equal(got, int4_reference(q, scale_zero, group).float().to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group_k", [(5, 256, 128), (3, 200, 64), (4, 96, 96), (2, 64, 128)])
def test_dequantize_fp8_is_the_formula_rounded_once(dtype, n, k, group_k):
    """Block-scaled (including a short last block) and one scale per row (group_k >= K)."""
    weight, scale = random_fp8(n, k, group_k, device="cpu", seed=k)
    got = dequantize_fp8(weight, scale, group_k, dtype)
    assert got.dtype == dtype and torch.equal(got, fp8_reference(weight, scale, group_k).float().to(dtype))


def test_scale_and_zero_words_hold_16_bit_scales_exactly_and_round_float32_ones():
    """A checkpoint's float16 or bfloat16 scale and a zero point 0..16 come back exactly from one word; a float32
    scale comes back rounded to 18 mantissa bits (2**-19 relative at most); zero points past 31 are refused."""
    g = torch.Generator().manual_seed(0)
    zero = torch.randint(0, 17, (64, 8), generator=g)
    for dtype in (torch.float16, torch.bfloat16):
        scale = (torch.rand(64, 8, generator=g) * 0.05 + 1e-4).to(dtype)
        words = pack_scale_zero(scale, zero)
        assert words.dtype == torch.int32
        got_scale, got_zero = unpack_scale_zero(words)
        assert torch.equal(got_scale, scale.float()) and torch.equal(got_zero, zero.float())
        assert torch.equal(scale_and_zero(words)[0], scale.double())
    scale = torch.rand(64, 8, generator=g) + 0.5
    got_scale, got_zero = unpack_scale_zero(pack_scale_zero(scale, zero.float()))
    assert torch.equal(got_zero, zero.float())
    assert 0 < (got_scale - scale).abs().div(scale).max() <= 2.0 ** -19
    with pytest.raises(ValueError, match=r"zero points must lie in 0..31, got 0..32"):
        pack_scale_zero(scale[:1, :2], torch.tensor([[0, 32]]))


def test_layout_errors_name_the_tensor_and_the_shape_expected():
    q, scale_zero = random_int4(4, 64, 32, device="cpu")
    packed = pack_int4(q)
    with pytest.raises(ValueError, match=r"int4 group_size must be even and divide K=64"):
        dequantize_int4(packed, scale_zero, 48, torch.float32)
    with pytest.raises(ValueError, match=r"int4 scale_zero .*int32 \[4, 2\]"):
        dequantize_int4(packed, scale_zero[:, :1].contiguous(), 32, torch.float32)
    with pytest.raises(ValueError, match=r"int4 scale_zero .*int32 \[4, 2\].*torch.float32"):
        dequantize_int4(packed, scale_zero.float(), 32, torch.float32)
    with pytest.raises(ValueError, match=r"int4 qweight must be a row-major 2-D uint8"):
        dequantize_int4(packed.to(torch.int32), scale_zero, 32, torch.float32)
    weight, scale = random_fp8(4, 64, 32, device="cpu")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(weight.float(), scale, 32, torch.float32)
    with pytest.raises(ValueError, match=r"fp8 scale .* \[4, 2\]"):
        dequantize_fp8(weight, scale.double(), 32, torch.float32)


# -- Triton kernels: the interpreter's tiny shapes on CPU --------------------------------------------------------

# (N, K, group, block_n, block_k): rows past N, a tile wider than a group, one narrower, a masked last tile.
INTERPRETER_INT4 = [(24, 256, 128, 8, 64), (19, 192, 32, 8, 128), (13, 200, 200, 8, 64), (8, 96, 32, 4, 128)]
# group_k: 128 (block-scaled), 64 with a short last block, and one scale per row.
INTERPRETER_FP8 = [(24, 256, 128, 8, 64), (19, 200, 64, 8, 128), (13, 200, 200, 8, 64), (9, 256, 256, 16, 512)]


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs Llama-3-8B's below")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group,block_n,block_k", INTERPRETER_INT4)
def test_interpreter_int4_gemv(dtype, n, k, group, block_n, block_k):
    from shardserve.kernels.triton.quant_gemv import int4_gemv

    q, scale_zero = random_int4(n, k, group, seed=n)
    x = torch.randn(k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = int4_gemv(x, pack_int4(q), scale_zero, group, block_n, block_k, num_warps=4, num_stages=1)
    assert got.shape == (1, n) and got.dtype == dtype
    assert relative_error(got[0], x.double() @ int4_reference(q, scale_zero, group).T) < TOLERANCE[dtype]


# (N, K, group, (block_n, split_k, num_warps, row_tiles)): several splits and row tiles with rows past N, a split
# of several groups, groups of 32 (sub-tiles of four words), one group a row.
INTERPRETER_SPLIT = [(70, 1024, 128, (32, 512, 4, 2)), (19, 192, 32, (8, 64, 4, 3)), (13, 256, 256, (16, 128, 4, 1)),
                     (40, 512, 64, (16, 256, 4, 2))]


def split_counts_are_zero() -> bool:
    from shardserve.kernels.triton import arrivals

    return all(counts.count_nonzero().item() == 0 for counts in arrivals._counts.values())


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs Llama-3-8B's below")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group,config", INTERPRETER_SPLIT)
def test_interpreter_int4_split_gemv(dtype, n, k, group, config):
    """The split-K GEMV (nibbles read as float32 denormals, partial sums over K splits summed by each row block's
    last program) against float64, the same bits on a second call, every arrival count back to 0."""
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split

    q, scale_zero = random_int4(n, k, group, seed=n)
    x = torch.randn(k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = int4_gemv_split(x, pack_int4(q), scale_zero, group, *config)
    assert got.shape == (1, n) and got.dtype == dtype
    assert relative_error(got[0], x.double() @ int4_reference(q, scale_zero, group).T) < TOLERANCE[dtype]
    assert split_counts_are_zero()
    assert torch.equal(int4_gemv_split(x, pack_int4(q), scale_zero, group, *config), got)


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 3e4])
def test_interpreter_int4_split_gemv_extreme_nibbles_and_inputs(magnitude):
    """Nibbles 0 and 15 in every position of a word, zero points 0 and 15, inputs from tiny to large: the
    denormal reading of each nibble and the scaling of x keep every product exact to float32 rounding."""
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split

    n, k, group = 16, 256, 32
    q = torch.zeros(n, k, dtype=torch.int64)
    q[::2] = 15
    q[:, 7::8] = 15 - q[:, 7::8]  # the last nibble of each word, read from the shifted word
    zero = torch.zeros(n, k // group)
    zero[:, 1::2] = 15
    scale_zero = pack_scale_zero(torch.full((n, k // group), 0.01), zero)
    x = torch.randn(k, generator=torch.Generator().manual_seed(5)) * magnitude
    got = int4_gemv_split(x, pack_int4(q), scale_zero, group, 8, 128, 4, 2)
    want = x.double() @ int4_reference(q, scale_zero, group).T
    assert relative_error(got[0], want) < 1e-6


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs Llama-3-8B's below")
@pytest.mark.parametrize("n,k,group,config", INTERPRETER_SPLIT)
def test_interpreter_int4_split_gemv_float16_sums(n, k, group, config):
    """Two words' products summed in float16 pairs (the interpreter's float32 model of the paired instructions):
    within float16's tolerance of float64 for float32 inputs from 1e-6 to 3e4 (each program scales x by its own
    power of two), for float16 inputs and with the norm inside; the same bits on a second call, SwiGLU out the
    same bits as the product then the SwiGLU kernel, a zero input giving zeros, every arrival count back to 0."""
    from shardserve.kernels.triton import fused_ops
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split, int4_gemv_split_rmsnorm

    q, scale_zero = random_int4(n, k, group, seed=n)
    qweight, w64 = pack_int4(q), int4_reference(q, scale_zero, group)
    for magnitude in (1e-6, 1.0, 3e4):
        x = torch.randn(k, generator=torch.Generator().manual_seed(1)) * magnitude
        got = int4_gemv_split(x, qweight, scale_zero, group, *config, True)
        assert relative_error(got[0], x.double() @ w64.T) < TOLERANCE[torch.float16], magnitude
    x = x.div(3e4).half()
    got = int4_gemv_split(x, qweight, scale_zero, group, *config, True)
    assert got.dtype == torch.float16 and relative_error(got[0], x.double() @ w64.T) < TOLERANCE[torch.float16]
    assert torch.equal(int4_gemv_split(x, qweight, scale_zero, group, *config, True), got)
    assert torch.equal(int4_gemv_split(torch.zeros(k).half(), qweight, scale_zero, group, *config, True),
                       torch.zeros(1, n).half())
    norm_args, h, summed = normed_input(k, torch.float16, True)
    got, got_sum = int4_gemv_split_rmsnorm(*norm_args, qweight, scale_zero, group, *config, True)
    assert relative_error(got[0], h[0].double() @ w64.T) < TOLERANCE[torch.float16]
    assert torch.equal(got_sum, summed)
    if n % 2 == 0:
        swiglu = int4_gemv_split(x, qweight, scale_zero, group, *config, True, swiglu_out=True)
        assert torch.equal(swiglu, fused_ops.silu_and_mul(int4_gemv_split(x, qweight, scale_zero, group, *config,
                                                                          True)))
    assert split_counts_are_zero()


@needs_triton
def test_int4_split_gemv_names_what_it_cannot_take():
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split, int4_split_sub

    assert int4_split_sub(4096, 128, 512) == 128 and int4_split_sub(4096, 4096, 512) == 512
    assert int4_split_sub(4000, 32, 512) is None  # K not a multiple of the split
    assert int4_split_sub(4096, 4, 512) is None  # a group narrower than a 32-bit word of eight nibbles
    q, scale_zero = random_int4(8, 96, 32, device="cpu")
    with pytest.raises(ValueError, match="cannot split K=96 in groups of 32 every 64 columns"):
        int4_gemv_split(torch.randn(96), pack_int4(q), scale_zero, 32, 8, 64)
    q, scale_zero = random_int4(8, 2048, 128, device="cpu")
    with pytest.raises(ValueError, match="float16 over splits of at most 1024 columns"):
        int4_gemv_split(torch.randn(2048), pack_int4(q), scale_zero, 128, 8, 2048, 4, 1, True)
    q, scale_zero = random_int4(8, 96, 8, device="cpu")
    with pytest.raises(ValueError, match="sub-tiles of at least 16"):
        int4_gemv_split(torch.randn(96), pack_int4(q), scale_zero, 8, 8, 32, 4, 1, True)

@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs Llama-3-8B's below")
@pytest.mark.parametrize("native", [True, False], ids=["fp8", "fp8-bits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group_k,block_n,block_k", INTERPRETER_FP8)
def test_interpreter_fp8_gemv(dtype, n, k, group_k, block_n, block_k, native, monkeypatch, set_env):
    """native=False decodes the e4m3 bits itself, the path of GPUs older than sm89."""
    from shardserve.kernels.triton import quant_gemv

    monkeypatch.setattr(quant_gemv, "_native_fp8", lambda device: native)
    weight, scale = random_fp8(n, k, group_k, seed=n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = quant_gemv.fp8_gemv(x, weight, scale, group_k, block_n, block_k, num_warps=4, num_stages=1)
    assert got.shape == (1, n) and got.dtype == dtype
    assert relative_error(got[0], x[0].double() @ fp8_reference(weight, scale, group_k).T) < TOLERANCE[dtype]
    # The first weight tile loaded before the wait for the kernel before (the default) or after it: the same bits.
    set_env(SHARDSERVE_GEMV_PRELOAD="0")
    assert torch.equal(quant_gemv.fp8_gemv(x, weight, scale, group_k, block_n, block_k, num_warps=4, num_stages=1),
                       got)


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs Llama-3-8B's below")
@pytest.mark.parametrize("native", [True, False], ids=["fp8", "fp8-bits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,block_n,block_k", [(24, 256, 8, 64), (13, 200, 8, 64), (9, 256, 16, 512)])
def test_interpreter_fp8_gemv_float16_sums(dtype, n, k, block_n, block_k, native, monkeypatch):
    """Partial sums in float16 (a ragged K and a single tile among the shapes): within the dtype's tolerance of
    float64, like the float32 sums; also with the norm inside and with SwiGLU out. native=False sums the decoded
    e4m3 bits (the values / 256) instead, the path of GPUs older than sm89. (Not for float32 models, whose
    tolerance they miss: start-up's check leaves them out there.)"""
    from shardserve.kernels.triton import fused_ops, quant_gemv

    monkeypatch.setattr(quant_gemv, "_native_fp8", lambda device: native)

    weight, scale = random_fp8(n, k, k, seed=n)
    w64 = fp8_reference(weight, scale, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    config = (block_n, block_k, 4, 1, True)
    plain = quant_gemv.fp8_gemv(x, weight, scale, k, *config)
    assert plain.dtype == dtype and relative_error(plain[0], x[0].double() @ w64.T) < TOLERANCE[dtype]
    norm_args, h, summed = normed_input(k, dtype, with_residual=True)
    got, got_sum = quant_gemv.fp8_gemv_rmsnorm(*norm_args, weight, scale, k, *config)
    assert torch.equal(got_sum, summed) and relative_error(got[0], h[0].double() @ w64.T) < TOLERANCE[dtype]
    if n % 2 == 0:
        assert torch.equal(quant_gemv.fp8_gemv(x, weight, scale, k, *config, swiglu_out=True),
                           fused_ops.silu_and_mul(plain))


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter; CUDA runs the same check below")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the float16 sums' own, on purpose
@pytest.mark.parametrize("native", [True, False], ids=["fp8", "fp8-bits"])
def test_interpreter_fp8_gemv_float16_sums_overflow_summed_again(native, monkeypatch):
    from shardserve.kernels.triton import quant_gemv

    monkeypatch.setattr(quant_gemv, "_native_fp8", lambda device: native)
    check_float16_overflow()


def check_float16_overflow() -> None:
    """An input far beyond what float16 partial sums hold (products of e4m3's 448 with 1e5): the rows it makes
    overflow are summed again in float32, so the output is finite and right, not inf."""
    from shardserve.kernels.triton import quant_gemv

    n, k = 16, 256
    weight, scale = random_fp8(n, k, k, seed=3)
    weight[:, :4] = torch.tensor(448.0).to(torch.float8_e4m3fn)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    x[0, :4] = 1e5
    want = x[0].double() @ fp8_reference(weight, scale, k).T
    assert 1e4 < want.abs().min() and want.abs().max() < 1e6  # finite in float32, beyond float16's sums
    got = quant_gemv.fp8_gemv(x, weight, scale, k, 8, 64, 4, 1, True)
    assert torch.isfinite(got).all() and relative_error(got[0], want) < TOLERANCE[torch.float32]


def block_scaled_fp8(n: int, k: int, rows: int, seed: int):
    """An FP8 weight [n, k] in groups of 128 columns whose scale rows each aligned run of `rows` rows shares (a
    block-scaled checkpoint's, expanded a row each), and its float64 reference. The scales are a checkpoint's
    magnitudes (1e-7 to 1e-6: weights of about 1e-4 over e4m3's 448), where x times them would underflow float16."""
    weight, scale = random_fp8(n, k, 128, seed=seed)
    scale = scale.reshape(-1, rows, scale.shape[1])[:, :1].expand(-1, rows, -1).reshape(n, -1) * 1e-3
    return weight, scale, fp8_reference(weight, scale, 128)


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs the same below")
@pytest.mark.parametrize("native", [True, False], ids=["fp8", "fp8-bits"])
@pytest.mark.parametrize("n,k,rows,block_n,block_k", [(32, 384, 32, 16, 256), (48, 512, 16, 16, 512),
                                                      (16, 384, 8, 8, 64)])
def test_interpreter_fp8_gemv_float16_sums_of_groups_whose_rows_share_scales(n, k, rows, block_n, block_k, native,
                                                                            monkeypatch):
    """Groups of 128 columns whose scales block_n rows share (block-scaled checkpoints): x enters each group times its
    scale and the rows sum in float16 pairs, within bfloat16's tolerance of float64, also with the norm inside and
    with a ragged last tile; rows_share_scales finds the runs, and a weight whose rows do not share them is refused
    where it cannot be split so, and with SwiGLU out."""
    from shardserve.kernels.triton import quant_gemv

    monkeypatch.setattr(quant_gemv, "_native_fp8", lambda device: native)
    weight, scale, w64 = block_scaled_fp8(n, k, rows, seed=n)
    assert quant_gemv.rows_share_scales(scale) == rows
    assert quant_gemv.rows_share_scales(random_fp8(n, k, 128, seed=1)[1]) == 1
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    config = (block_n, block_k, 4, 1, True)
    got = quant_gemv.fp8_gemv(x, weight, scale, 128, *config)
    assert relative_error(got[0], x[0].double() @ w64.T) < TOLERANCE[torch.bfloat16]
    norm_args, h, summed = normed_input(k, torch.bfloat16, with_residual=True)
    got, got_sum = quant_gemv.fp8_gemv_rmsnorm(*norm_args, weight, scale, 128, *config)
    assert torch.equal(got_sum, summed) and relative_error(got[0], h[0].double() @ w64.T) < TOLERANCE[torch.bfloat16]
    with pytest.raises(ValueError, match="rows that share their scales in runs of block_n 16, without SwiGLU out"):
        quant_gemv.fp8_gemv(x, weight, scale, 128, 16, 64, 4, 1, True, swiglu_out=True)
    with pytest.raises(ValueError, match="in runs of block_n 16"):
        quant_gemv.fp8_gemv(x, weight[:n - 8], scale[:n - 8], 128, 16, 64, 4, 1, True)


def test_float_weights_quantized_in_row_blocks_share_each_blocks_scales():
    """--load-format dummy (or a float checkpoint) loading into a block-scaled FP8 layout: one scale a block of 128
    rows and 128 columns as a block-scaled checkpoint's, counted from the checkpoint's row 0 where a rank's rows
    start inside a block; the GEMV configurations with float16 sums of groups are then timed for it."""
    from shardserve.layers.quantization.fp8 import FP8_F16_CANDIDATES, quantize_fp8
    from shardserve.layers.quantization.packed import PackedLayout

    values = torch.randn(200, 256, generator=torch.Generator().manual_seed(0))
    codes, scale = quantize_fp8(values, 128, block_rows=128, first_row=64)  # rows 64..263: blocks 0, 1, 2
    assert torch.equal(scale[:64], scale[:1].expand(64, -1))
    assert torch.equal(scale[64:192], scale[64:65].expand(128, -1)) and not torch.equal(scale[63], scale[64])
    assert torch.equal(scale[:64].amax(), (values[:64].abs().amax() / 448.0))
    dequantized = codes.float().reshape(200, 2, 128) * scale[:, :, None]
    assert relative_error(dequantized.reshape(200, 256), values.double()) < 0.05
    layer = packed_layer(256, 256, PackedLayout("fp8", 128, block_rows=128), torch.bfloat16)
    assert layer.packed.scale_rows(layer) == 32 and layer.packed.config_key(layer) == "fp8/128/256/256/rows32"
    fp8 = layer.packed.format
    assert set(FP8_F16_CANDIDATES) <= set(fp8.tiled_candidates(layer.packed, 32))
    assert not set(FP8_F16_CANDIDATES) & set(fp8.tiled_candidates(layer.packed, 1))
    rowwise = packed_layer(256, 256, PackedLayout("fp8", 128), torch.bfloat16)
    assert rowwise.packed.scale_rows(rowwise) == 1 and rowwise.packed.config_key(rowwise) == "fp8/128/256/256"


def normed_input(k: int, dtype, with_residual: bool, seed: int = 2):
    """(x, residual or None, norm weight, eps) of one row, and the norm's output and the sum as the model's
    norm kernel makes them (fused_add_rms_norm, or rms_norm without a residual)."""
    from shardserve.kernels.triton import fused_ops

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).mul_(3).to(DEVICE, dtype)
    residual = torch.randn(1, k, generator=g).to(DEVICE, dtype) if with_residual else None
    norm_weight = torch.rand(k, generator=g).add_(0.5).to(DEVICE, dtype)
    if with_residual:
        h, summed = fused_ops.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, 1e-5)
    else:
        h, summed = fused_ops.rms_norm(x, norm_weight, 1e-5), x
    return (x, residual, norm_weight, 1e-5), h, summed


def check_normed_gemv(kind: str, n: int, k: int, group: int, dtype, with_residual: bool, config) -> None:
    """The norm-fused packed GEMV equals the norm kernel followed by the packed GEMV: the same sum bit for bit,
    products within the dtype's tolerance of float64 on the norm's output."""
    from shardserve.kernels.triton import quant_gemv

    norm_args, h, summed = normed_input(k, dtype, with_residual)
    if kind == "fp8":
        weight, scale = random_fp8(n, k, group, seed=n)
        got, got_sum = quant_gemv.fp8_gemv_rmsnorm(*norm_args, weight, scale, group, *config)
        want = h[0].double() @ fp8_reference(weight, scale, group).T
    else:
        q, scale_zero = random_int4(n, k, group, seed=n)
        fused = quant_gemv.int4_gemv_split_rmsnorm if kind == "int4-split" else quant_gemv.int4_gemv_rmsnorm
        got, got_sum = fused(*norm_args, pack_int4(q), scale_zero, group, *config)
        want = h[0].double() @ int4_reference(q, scale_zero, group).T
    assert torch.equal(got_sum, summed)
    assert got.shape == (1, n) and relative_error(got[0], want) < TOLERANCE[dtype]


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs Llama-3-8B's below")
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,n,k,group,block_n,block_k", [
    ("fp8", 24, 256, 128, 8, 64), ("fp8", 13, 200, 200, 8, 64), ("int4", 19, 192, 32, 8, 128),
    ("int4", 13, 200, 200, 8, 64), ("int4-split", 19, 192, 32, 8, 64), ("int4-split", 40, 512, 128, 16, 256)])
def test_interpreter_norm_fused_packed_gemv(kind, n, k, group, block_n, block_k, dtype, with_residual):
    """block_k: the split kernel's split_k (with two row tiles)."""
    check_normed_gemv(kind, n, k, group, dtype, with_residual, (block_n, block_k, 4, 2 if "split" in kind else 1))


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("kind,group", [("fp8", 4096), ("fp8", 128), ("int4", 128), ("int4-split", 128)])
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (3072, 4096), (24, 256)])
def test_gpu_norm_fused_packed_gemv(kind, group, n, k):
    configs = split_configs(k, group) if kind == "int4-split" else CONFIGS
    for config in configs:
        check_normed_gemv(kind, n, k, min(group, k), torch.bfloat16, True, config)
    check_normed_gemv(kind, n, k, min(group, k), torch.bfloat16, False, configs[0])


@needs_triton
@pytest.mark.parametrize("native", [True, False], ids=["fp8", "fp8-bits"])
@pytest.mark.parametrize("features,k,group_k,block_n,block_k", [(12, 256, 128, 8, 64), (13, 200, 200, 4, 64),
                                                                pytest.param(1024, 4096, 4096, 4, 1024,
                                                                             marks=pytest.mark.gpu)])
def test_fp8_gemv_with_swiglu_output_equals_the_product_then_swiglu(features, k, group_k, block_n, block_k, native,
                                                                     monkeypatch):
    """A [gate | up] FP8 projection whose launch returns silu(gate) * up: the same bits as the FP8 GEMV followed by
    the SwiGLU kernel, plain and with the norm inside (and its new residual)."""
    from shardserve.kernels.triton import fused_ops, quant_gemv

    if not CUDA and features > 64:
        pytest.skip("a GPU shape")
    monkeypatch.setattr(quant_gemv, "_native_fp8", lambda device: native)
    dtype = torch.bfloat16 if CUDA else torch.float16
    weight, scale = random_fp8(2 * features, k, group_k, seed=features)
    norm_args, _, summed = normed_input(k, dtype, True)
    config = (block_n, block_k, 4, 1)
    got = quant_gemv.fp8_gemv(norm_args[0], weight, scale, group_k, *config, swiglu_out=True)
    assert got.shape == (1, features)
    assert torch.equal(got, fused_ops.silu_and_mul(quant_gemv.fp8_gemv(norm_args[0], weight, scale, group_k, *config)))
    got, got_sum = quant_gemv.fp8_gemv_rmsnorm(*norm_args, weight, scale, group_k, *config, swiglu_out=True)
    product, _ = quant_gemv.fp8_gemv_rmsnorm(*norm_args, weight, scale, group_k, *config)
    assert torch.equal(got, fused_ops.silu_and_mul(product)) and torch.equal(got_sum, summed)


@needs_triton
@pytest.mark.parametrize("features,k,group,config", [(12, 256, 32, (8, 128, 4, 2)), (13, 256, 64, (8, 64, 4, 1)),
                                                     (20, 512, 128, (16, 256, 4, 2)),
                                                     pytest.param(14336, 4096, 128, (64, 512, 4, 4),
                                                                  marks=pytest.mark.gpu),
                                                     pytest.param(14336, 4096, 128, (16, 4096, 4, 1),
                                                                  marks=pytest.mark.gpu),
                                                     pytest.param(14336, 4096, 128, (64, 512, 4, 1, 1),
                                                                  marks=pytest.mark.gpu)])
def test_int4_split_gemv_with_swiglu_output_equals_the_product_then_swiglu(features, k, group, config):
    """A [gate | up] 4-bit projection whose split-K launch returns silu(gate) * up: the same bits as the split-K
    GEMV followed by the SwiGLU kernel, plain and with the norm inside (and its new residual); odd feature counts
    and row blocks past the last feature included, every arrival count back to 0."""
    from shardserve.kernels.triton import fused_ops, quant_gemv

    if not CUDA and features > 64:
        pytest.skip("a GPU shape")
    dtype = torch.bfloat16 if CUDA else torch.float16
    q, scale_zero = random_int4(2 * features, k, group, seed=features)
    qweight = pack_int4(q)
    norm_args, _, summed = normed_input(k, dtype, True)
    got = quant_gemv.int4_gemv_split(norm_args[0], qweight, scale_zero, group, *config, swiglu_out=True)
    assert got.shape == (1, features)
    product = quant_gemv.int4_gemv_split(norm_args[0], qweight, scale_zero, group, *config)
    assert torch.equal(got, fused_ops.silu_and_mul(product))
    got, got_sum = quant_gemv.int4_gemv_split_rmsnorm(*norm_args, qweight, scale_zero, group, *config,
                                                      swiglu_out=True)
    product, _ = quant_gemv.int4_gemv_split_rmsnorm(*norm_args, qweight, scale_zero, group, *config)
    assert torch.equal(got, fused_ops.silu_and_mul(product)) and torch.equal(got_sum, summed)
    assert split_counts_are_zero()


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs the whole-row candidate on Llama-3-8B's")
@pytest.mark.parametrize("n,k,group,config,chunk", [(19, 256, 32, (8, 256, 4, 2), 64),
                                                    (24, 512, 512, (16, 512, 4, 1), 128),
                                                    (40, 512, 128, (16, 256, 4, 2), 128)])
def test_interpreter_int4_split_gemv_walks_wide_splits_in_chunks(n, k, group, config, chunk, monkeypatch):
    """Splits wider than the kernel's chunk of columns: whole rows (one split, each program storing its own rows)
    and two splits of two chunks each (over two row tiles: the first tile's first chunk is summed before the
    loop), against float64, plain, with the norm inside and with SwiGLU output (the same bits as the
    product then the SwiGLU kernel). The first chunk loaded before the dependent-launch wait or after it: the
    same bits."""
    from shardserve.kernels.triton import fused_ops, quant_gemv

    monkeypatch.setattr(quant_gemv, "INT4_SPLIT_CHUNK", chunk)
    q, scale_zero = random_int4(n, k, group, seed=n)
    qweight, want = pack_int4(q), int4_reference(q, scale_zero, group)
    x = torch.randn(k, generator=torch.Generator().manual_seed(1))
    got = quant_gemv.int4_gemv_split(x, qweight, scale_zero, group, *config)
    assert relative_error(got[0], x.double() @ want.T) < TOLERANCE[torch.float32]
    with envs.override(SHARDSERVE_GEMV_PRELOAD="0"):  # the first tile loaded after the wait
        assert torch.equal(quant_gemv.int4_gemv_split(x, qweight, scale_zero, group, *config), got)
    norm_args, h, summed = normed_input(k, torch.float32, True)
    got, got_sum = quant_gemv.int4_gemv_split_rmsnorm(*norm_args, qweight, scale_zero, group, *config)
    assert relative_error(got[0], h[0].double() @ want.T) < TOLERANCE[torch.float32]
    assert torch.equal(got_sum, summed)
    if n % 2 == 0:
        swiglu = quant_gemv.int4_gemv_split(x, qweight, scale_zero, group, *config, swiglu_out=True)
        product = quant_gemv.int4_gemv_split(x, qweight, scale_zero, group, *config)
        assert torch.equal(swiglu, fused_ops.silu_and_mul(product))
    assert split_counts_are_zero()


def split_configs(k: int, group: int) -> list[tuple[int, ...]]:
    """The start-up candidates of the split-K GEMV that take K columns in groups of `group`, and a small one
    (rows past N on the tiny shape, several splits); each also with float16 sums (a fifth element 1)."""
    from shardserve.kernels.triton.quant_gemv import int4_split_sub
    from shardserve.layers.quantization.int4 import INT4_SPLIT_CANDIDATES

    configs = [c for c in INT4_SPLIT_CANDIDATES + ((16, 128, 4, 2),) if int4_split_sub(k, min(group, k), c[1])]
    return configs + [(*c, 1) for c in configs]


@needs_triton
@pytest.mark.skipif(CUDA, reason="CUDA checks the kernel through dequantize_int4 below")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreter_dequantize_int4_kernel_equals_torch(dtype):
    from shardserve.kernels.triton.quant_gemv import dequantize_int4_cuda

    q, scale_zero = random_int4(19, 320, 64, seed=3)
    got = dequantize_int4_cuda(pack_int4(q), scale_zero, 64, dtype, block_r=8, block_c=64)
    assert torch.equal(got, dequantize_int4(pack_int4(q), scale_zero, 64, dtype))


@needs_triton
def test_kernels_reject_bad_inputs_with_the_reason():
    from shardserve.kernels.triton.quant_gemv import fp8_gemv, int4_gemv

    q, scale_zero = random_int4(8, 64, 32)
    with pytest.raises(ValueError, match="int4_gemv needs x with 64"):
        int4_gemv(torch.randn(1, 32, device=DEVICE), pack_int4(q), scale_zero, 32)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        int4_gemv(torch.randn(1, 64, device=DEVICE), pack_int4(q), scale_zero, 32, block_k=96)
    weight, scale = random_fp8(8, 64, 32)
    with pytest.raises(ValueError, match="fp8_gemv needs x with 64 bfloat16, float16 or float32"):
        fp8_gemv(torch.randn(1, 64, device=DEVICE).double(), weight, scale, 32)
    with pytest.raises(ValueError, match=r"fp8 scale .* \[8, 1\]"):
        fp8_gemv(torch.randn(1, 64, device=DEVICE), weight, scale, 64)


# -- Triton kernels on CUDA: real shapes, CUDA graphs -----------------------------------------------------------


def _check_configs(run, x_by_dtype, w64, what: str, configs=CONFIGS) -> list[str]:
    """Failures of run(x, config) against x @ w64^T for every dtype and config, as readable lines."""
    failures = []
    for dtype, x in x_by_dtype.items():
        want = x.double() @ w64.T
        for config in configs:
            got = run(x, config)
            error = relative_error(got[0], want) if got.shape == (1, w64.shape[0]) else float("inf")
            if not (got.dtype == dtype and error < TOLERANCE[dtype]):
                failures.append(f"{what} {dtype} {config}: error {error:.2g}, dtype {got.dtype}")
    return failures


def _inputs(k: int) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(k)
    x = torch.randn(k, generator=g, device=DEVICE)
    return {dtype: x.to(dtype) for dtype in (torch.bfloat16, torch.float16)}


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("kernel", ["tiled", "split"])
@pytest.mark.parametrize("n,k", LLAMA3_8B + LM_HEAD + [TINY])
def test_gpu_int4_gemv(n, k, kernel):
    """Group sizes 32, 64, 128 and K; every config for bfloat16 and float16 inputs (the split-K kernel: every
    start-up candidate that takes the shape, with float32 and with float16 sums, and the arrival counts back to 0
    after all of it)."""
    from shardserve.kernels.triton.quant_gemv import int4_gemv, int4_gemv_split

    gemv = int4_gemv_split if kernel == "split" else int4_gemv
    failures = []
    for group in (32, 64, 128, k):
        q, scale_zero = random_int4(n, k, group, seed=group)
        qweight, w64 = pack_int4(q), int4_reference(q, scale_zero, group)
        del q
        run = lambda x, c: gemv(x, qweight, scale_zero, group, *c)  # noqa: E731
        failures += _check_configs(run, _inputs(k), w64, f"int4 {kernel} {n}x{k} group {group}",
                                   split_configs(k, group) if kernel == "split" else CONFIGS)
    assert not failures, "\n".join(failures)
    torch.cuda.synchronize()
    assert split_counts_are_zero()


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("n,k", LLAMA3_8B + [TINY])
def test_gpu_fp8_gemv(n, k):
    """Block-scaled with group_k 128 and one scale per row; every config for bfloat16 and float16 inputs."""
    from shardserve.kernels.triton.quant_gemv import fp8_gemv

    failures = []
    for group_k in (128, k):
        weight, scale = random_fp8(n, k, group_k, seed=group_k)
        w64 = fp8_reference(weight, scale, group_k)
        run = lambda x, c: fp8_gemv(x, weight, scale, group_k, *c)  # noqa: E731
        # One scale a row also sums in float16 pairs (the native conversions' inline assembly).
        configs = CONFIGS + [(16, 512, 4, 2, True), (8, 1024, 4, 3, True), (4, 4096, 8, 2, True)] * (group_k == k)
        failures += _check_configs(run, _inputs(k), w64, f"fp8 {n}x{k} group_k {group_k}", configs)
    # Groups whose scales runs of 32 rows share (128 x 128 blocks): float16 sums of x times each group's scale.
    if n % 32 == 0:
        weight, scale, w64 = block_scaled_fp8(n, k, 32, seed=5)
        run = lambda x, c: fp8_gemv(x, weight, scale, 128, *c)  # noqa: E731
        failures += _check_configs(run, _inputs(k), w64, f"fp8 {n}x{k} blocks", [(16, 1024, 4, 2, True),
                                                                                 (32, 256, 4, 3, True)])
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU")
def test_gpu_fp8_gemv_float16_sums_overflow_summed_again():
    check_float16_overflow()


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("n,k,group_k", [(4096, 14336, 128), (24, 256, 256), (3072, 4000, 128)])
def test_gpu_fp8_gemv_from_bits(n, k, group_k, monkeypatch):
    """The path for GPUs without fp8 conversions (decoding e4m3 bits), here on a GPU that has them; the last
    shape has a short last scale block."""
    from shardserve.kernels.triton import quant_gemv

    monkeypatch.setattr(quant_gemv, "_native_fp8", lambda device: False)
    weight, scale = random_fp8(n, k, group_k)
    run = lambda x, c: quant_gemv.fp8_gemv(x, weight, scale, group_k, *c)  # noqa: E731
    failures = _check_configs(run, _inputs(k), fp8_reference(weight, scale, group_k), f"fp8-bits {n}x{k}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,group", [(4096, 14336, 128), (28672, 4096, 32), (24, 256, 256), (37, 192, 64)])
def test_gpu_dequantize_int4_equals_torch(dtype, n, k, group):
    """One launch on CUDA, the same bits as the torch formula on CPU."""
    q, scale_zero = random_int4(n, k, group)
    got = dequantize_int4(pack_int4(q), scale_zero, group, dtype)
    assert torch.equal(got.cpu(), dequantize_int4(pack_int4(q).cpu(), scale_zero.cpu(), group, dtype))


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_replays_in_cuda_graph_with_a_new_input():
    from shardserve.kernels.triton.quant_gemv import fp8_gemv, int4_gemv, int4_gemv_split

    n, k, group = 4096, 4096, 128
    q, scale_zero = random_int4(n, k, group)
    qweight = pack_int4(q)
    weight, fp8_scale = random_fp8(n, k, group)
    launches = {"int4": lambda x: int4_gemv(x, qweight, scale_zero, group),
                "int4-split": lambda x: int4_gemv_split(x, qweight, scale_zero, group),
                "fp8": lambda x: fp8_gemv(x, weight, fp8_scale, group)}
    for name, launch in launches.items():
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        launch(x)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = launch(x)
        new_x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, launch(new_x)), name


@needs_triton
@pytest.mark.parametrize("m, k", [(1, 4096), (5, 300), (64, 14336)])
def test_per_row_fp8_activation_quantization(m, k):
    """quantize_rows_fp8: each row scaled so its largest magnitude is 448, rounded to float8_e4m3fn, exactly as
    the torch expression of the same rule."""
    from shardserve.kernels.triton.quant_gemv import quantize_rows_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(m, k, device=device).to(torch.bfloat16 if device == "cuda" else torch.float32)
    x[0, 0] = 0  # a zero stays zero
    q, scale = quantize_rows_fp8(x)
    want_scale = (x.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
    torch.testing.assert_close(scale, want_scale, rtol=2e-7, atol=0)
    if device == "cuda":  # every value within half an FP8 step of its own (2^-4 relative; subnormals 2^-10 * scale)
        error = (q.float() * scale - x.float()).abs()
        assert (error <= x.float().abs() / 16 + scale * 2**-10).all() and q.float()[0, 0] == 0
    else:  # the interpreter's float32 -> float8 rounding carries wrongly into the exponent (127.2 -> 64) now and then
        want = (x.float() / want_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert (q.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.95


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("n,k,group,config", [(24, 96, 16, (16, 48, 4, 1)), (19, 112, 16, (8, 112, 4, 2)),
                                              (40, 192, 32, (16, 96, 4, 1))])
def test_interpreter_int4_split_gemv_pads_splits_that_are_not_powers_of_two(n, k, group, config):
    """Splits of 48, 112 and 96 columns held padded to 64 and 128 (float16 sums): the padding's sub-tiles read no
    words and take no scale or zero point, with the norm inside too; float32 sums refuse such a split; start-up
    offers them only where K takes no power-of-two split."""
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split, int4_gemv_split_rmsnorm
    from shardserve.layers.quantization.int4 import split_forms

    q, scale_zero = random_int4(n, k, group, seed=n)
    qweight, w64 = pack_int4(q), int4_reference(q, scale_zero, group)
    x = torch.randn(k, generator=torch.Generator().manual_seed(1))
    got = int4_gemv_split(x, qweight, scale_zero, group, *config, True)
    assert relative_error(got[0], x.double() @ w64.T) < TOLERANCE[torch.float16]
    norm_args, h, summed = normed_input(k, torch.float16, True)
    got, got_sum = int4_gemv_split_rmsnorm(*norm_args, qweight, scale_zero, group, *config, True)
    assert relative_error(got[0], h[0].double() @ w64.T) < TOLERANCE[torch.float16]
    assert torch.equal(got_sum, summed) and split_counts_are_zero()
    with pytest.raises(ValueError, match="not a power of two"):
        int4_gemv_split(x, qweight, scale_zero, group, *config)
    assert {form[1] for form in split_forms(2688, 16)} == {896, 448, 384}
    assert all(form[1] in (512, 1024) for form in split_forms(4096, 128))
