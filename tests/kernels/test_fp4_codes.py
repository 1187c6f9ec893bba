"""The packed "fp4" layout (kernels/quant_pack.py: e2m1 codes in int4's nibbles, an e4m3 scale byte a group and a
float32 scale a row) through the 4-bit kernels' e2m1 decode table: the torch dequantizer is exact against the float64
definition, and in Triton's interpreter (tiny shapes) the tiled GEMV, the split-K GEMV's float16 sums, the GEMM and
the dequantize kernel agree with it; the same kernels with the int4 table (the same group scales as int4 words), or
with the row scales left out or taken from another row, are wrong, and a layer dequantizing either way fails the
start-up check. quantize_fp4 rounds floats to the layout within e2m1's half step. On a GPU, the split-K GEMV's
paired instructions on Nemotron-3-Nano's and Llama-3-8B's shapes."""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from shardserve.kernels.quant_pack import (E2M1_VALUES, dequantize_int4, fp4_scale_bytes,  # noqa: E402
                                           fp4_scales, pack_int4, pack_scale_zero, quantize_fp4,
                                           reference_weight64)
from shardserve.kernels.self_check import TOLERANCE, relative_error  # noqa: E402
from shardserve.layers.quantization.check import check_packed  # noqa: E402
from shardserve.layers.quantization.packed import PackedLayout, PackedWeights  # noqa: E402
from tests.helpers.kernels import CUDA, DEVICE, packed_layer  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
N, K, GROUP = 24, 64, 16  # a partial row tile for block_n 16, four groups a row


def random_fp4(n: int = N, k: int = K, group: int = GROUP, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed e2m1 codes [n, k / 2], e4m3 scale bytes [n, k / group], row scales float32 [n]): every code, group
    scales as NVFP4's are (e4m3 values up to 448, a few of them subnormal), and a row scale 1.7e-4 times a power of
    two from 2**-4 to 2**4 times 1 to 2, different from row to row (a kernel that ignored it, or read another
    row's, would be far off)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    e4m3 = torch.rand(n, k // group, generator=g) * 448 * torch.exp2(-torch.randint(0, 12, (n, k // group),
                                                                                    generator=g).float())
    rows = 1.7e-4 * torch.exp2(torch.randint(-4, 5, (n,), generator=g).float()) * (1 + torch.rand(n, generator=g))
    return (pack_int4(codes).to(DEVICE), fp4_scale_bytes(e4m3.to(torch.float8_e4m3fn)).to(DEVICE),
            rows.float().to(DEVICE))


def as_int4_words(scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """fp4 scale bytes and row scales as the int4 layout's words of the same group scales, zero points 0: the codes
    then read through the int4 table (integers 0..15) rather than e2m1's."""
    scales = fp4_scales(scale, row_scale)
    return pack_scale_zero(scales, torch.zeros_like(scales))


def wrong_rows(row_scale: torch.Tensor) -> list[torch.Tensor]:
    """Row scales a kernel might wrongly use: none (ones), and each row another's."""
    return [torch.ones_like(row_scale), row_scale.roll(1).contiguous()]


def test_the_e2m1_table_and_the_torch_dequantizer_are_the_definition():
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert all(E2M1_VALUES[8 + i] == -E2M1_VALUES[i] for i in range(8))
    qweight, scale, rows = random_fp4()
    want = reference_weight64("fp4", qweight, scale, GROUP, rows)
    # float64's product is exact; float32's is it rounded once.
    got = dequantize_int4(qweight, scale, GROUP, torch.float32, codes="fp4", row_scale=rows)
    assert torch.equal(got, want.float())
    for wrong in wrong_rows(rows):
        assert not torch.equal(dequantize_int4(qweight, scale, GROUP, torch.float32, codes="fp4", row_scale=wrong),
                               got)
    # One byte: column 0 in the low nibble (code 3 = 1.5), column 1 in the high one (code 13 = -3), an e4m3 scale
    # of 0.75 (byte 0x34) under a row scale of 4.
    byte = torch.tensor([[0xD3]], dtype=torch.uint8)
    one = reference_weight64("fp4", byte, torch.tensor([[0x34]], dtype=torch.uint8), 2, torch.tensor([4.0]))
    assert one.tolist() == [[4.5, -9.0]]
    # The group scale is e4m3 times the row scale rounded once to float32, before the product.
    e4m3, row = torch.tensor([[1.125]]).to(torch.float8_e4m3fn), torch.tensor([1.0 + 2.0 ** -22])
    once = reference_weight64("fp4", byte, fp4_scale_bytes(e4m3), 2, row)
    assert once[0, 0].item() == 1.5 * float(torch.tensor(1.125) * row[0])


def test_the_layout_checks_refuse_a_missing_row_scale_and_each_others_scales():
    """fp4 needs its row scales (float32, one a row); its e4m3 bytes are not int4 words, nor the other way round."""
    qweight, scale, rows = random_fp4(4, 32, 16)
    with pytest.raises(ValueError, match="fp4 weights of 4 rows need their row scales"):
        dequantize_int4(qweight, scale, 16, torch.float32, codes="fp4")
    with pytest.raises(ValueError, match="row scales, contiguous float32 \\[4\\], got torch.float16"):
        dequantize_int4(qweight, scale, 16, torch.float32, codes="fp4", row_scale=rows.half())
    with pytest.raises(ValueError, match="int4 scale_zero .* torch.int32 .*got torch.uint8"):
        dequantize_int4(qweight, scale, 16, torch.float32)
    with pytest.raises(ValueError, match="fp4 e4m3 scale bytes .* torch.uint8 .*got torch.int32"):
        dequantize_int4(qweight, as_int4_words(scale, rows), 16, torch.float32, codes="fp4", row_scale=rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_fp4_rounds_within_half_an_e2m1_step(seed):
    """quantize_fp4 as NVFP4 quantizes: the row scale puts the row's largest |value| at 6 * 448 (so it comes back
    as itself: code 6 under an e4m3 scale of 448), and every value comes back within half a step of e2m1's grid at
    its group's scale (a quarter of |value| at 2 and above, a quarter of the scale below), with rows of magnitudes
    1e-3 to 1e3 each on their own scale; a row of zeros stays zeros."""
    g = torch.Generator().manual_seed(seed)
    n, k, group = 12, 96, 16
    values = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, n)[:, None]
    values[3, 20:40] *= 30  # parts of two groups far above the row's others
    values[n - 1] = 0
    codes, scale, rows = quantize_fp4(values, group)
    assert (codes.dtype, scale.dtype, rows.dtype) == (torch.uint8, torch.uint8, torch.float32)
    assert (codes.shape, scale.shape, rows.shape) == ((n, k // 2), (n, k // group), (n,))
    got = dequantize_int4(codes, scale, group, torch.float32, codes="fp4", row_scale=rows)
    largest = values.abs().amax(dim=1)
    torch.testing.assert_close(rows[:-1] * (6 * 448), largest[:-1], rtol=1e-6, atol=0)
    torch.testing.assert_close(got.abs().amax(dim=1), largest, rtol=1e-6, atol=0)
    full = fp4_scales(scale, rows).repeat_interleave(group, dim=1)
    bound = 0.25 * torch.maximum(values.abs(), full) * (1 + 1e-6)
    assert ((got - values).abs() <= bound).all()
    assert torch.equal(got[n - 1], torch.zeros(k))
    # Each group's own scale: a group's largest value lands near e2m1's 6 (e4m3's rounding: within 6 * 17/16).
    groups = values.abs().reshape(n, -1, group).amax(dim=2)[:-1]
    ratio = groups / fp4_scales(scale, rows)[:-1]
    assert (ratio > 6 * 15 / 16).all() and (ratio < 6 * 17 / 16).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreter_gemv_and_dequantize_decode_e2m1(dtype):
    from shardserve.kernels.triton.quant_gemv import dequantize_int4_cuda, int4_gemv

    qweight, scale, rows = random_fp4()
    x = torch.randn(K, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    want = x.double().cpu() @ reference_weight64("fp4", qweight, scale, GROUP, rows).cpu().T
    got = int4_gemv(x, qweight, scale, GROUP, 16, 32, num_warps=4, num_stages=1, codes="fp4", row_scale=rows)
    assert relative_error(got[0], want) < TOLERANCE[dtype]
    # The same kernel with the int4 table (the codes as integers, under the same group scales) is wrong, and so is
    # the e2m1 table without the row scales or with another row's.
    wrong = int4_gemv(x, qweight, as_int4_words(scale, rows), GROUP, 16, 32, num_warps=4, num_stages=1)
    assert relative_error(wrong[0], want) > 100 * TOLERANCE[dtype]
    for other in wrong_rows(rows):
        wrong = int4_gemv(x, qweight, scale, GROUP, 16, 32, num_warps=4, num_stages=1, codes="fp4", row_scale=other)
        assert relative_error(wrong[0], want) > 100 * TOLERANCE[dtype]
    dequantized = dequantize_int4_cuda(qweight, scale, GROUP, dtype, block_r=8, block_c=16, codes="fp4",
                                       row_scale=rows)
    assert torch.equal(dequantized, dequantize_int4(qweight.cpu(), scale.cpu(), GROUP, dtype, codes="fp4",
                                                    row_scale=rows.cpu()).to(DEVICE))


@needs_triton
def test_interpreter_gemm_decodes_e2m1():
    from shardserve.kernels.triton.quant_gemm import GemmConfig, int4_gemm

    qweight, scale, rows = random_fp4(seed=2)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    config = GemmConfig(16, 16, 16, 4, 1)  # groups of 16: tiles of 32 columns, two groups each
    got = int4_gemm(x, qweight, scale, GROUP, config, codes="fp4", row_scale=rows)
    want = x.double().cpu() @ reference_weight64("fp4", qweight, scale, GROUP, rows).cpu().T
    assert relative_error(got, want) < TOLERANCE[torch.float16]
    rolled = int4_gemm(x, qweight, scale, GROUP, config, codes="fp4", row_scale=wrong_rows(rows)[1])
    assert relative_error(rolled, want) > 100 * TOLERANCE[torch.float16]


def _int4_table(self, layer, dtype):
    """A packed fp4 layer's weight decoded with the int4 table (its codes as integers, the same group scales)."""
    return dequantize_int4(layer.weight, as_int4_words(layer.weight_scale, layer.weight_row_scale), self.group,
                           dtype)


def _without_row_scales(self, layer, dtype):
    """A packed fp4 layer's weight decoded as e2m1 under its e4m3 group scales alone."""
    return dequantize_int4(layer.weight, layer.weight_scale, self.group, dtype, codes="fp4",
                           row_scale=torch.ones_like(layer.weight_row_scale))


@pytest.mark.parametrize("wrong", [_int4_table, _without_row_scales])
def test_the_start_up_check_fails_a_layer_that_decodes_fp4_wrongly(monkeypatch, wrong):
    """check_packed compares every packed shape with the float64 definition: a packed fp4 layer (e4m3 bytes a group,
    float32 scales a row) passes, and the same layer whose products dequantize with the int4 table, or without its
    row scales, is reported."""
    layer = packed_layer(N, K, PackedLayout("fp4", GROUP), torch.float32)
    assert (layer.weight_scale.dtype, tuple(layer.weight_scale.shape)) == (torch.uint8, (N, K // GROUP))
    assert (layer.weight_row_scale.dtype, tuple(layer.weight_row_scale.shape)) == (torch.float32, (N,))
    model = nn.ModuleList([layer])
    assert check_packed(model) == []
    monkeypatch.setattr(PackedWeights, "dequantized", wrong)
    failures = check_packed(model)
    assert failures and all(f.startswith("fp4") and "error" in f for f in failures)


# Several splits and row tiles with rows past N; splits of 48 and 112 columns, held padded to 64 and 128.
SPLIT_CASES = [(24, 64, 16, (16, 64, 4, 1)), (19, 192, 32, (8, 64, 4, 3)), (40, 512, 16, (16, 256, 4, 2)),
               (24, 96, 16, (16, 48, 4, 1)), (19, 112, 16, (8, 112, 4, 2))]


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs real ones below")
@pytest.mark.parametrize("n,k,group,config", SPLIT_CASES)
def test_interpreter_split_gemv_reads_e2m1_codes_into_float16_pairs(n, k, group, config):
    """Every code in every nibble position, inputs from 1e-6 to 3e4 (each program scales x by its own power of two),
    the norm inside, SwiGLU out, several splits and row tiles with rows past N: within float16's tolerance of
    float64; the same kernel reading the codes as int4 nibbles (under the same group scales), or taking another
    row's row scale, is wrong; float32 sums are refused for e2m1 codes."""
    from shardserve.kernels.triton import fused_ops
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split, int4_gemv_split_rmsnorm

    qweight, scale, rows = random_fp4(n, k, group, seed=n)
    w64 = reference_weight64("fp4", qweight, scale, group, rows).cpu()
    fp4 = dict(codes="fp4", row_scale=rows)
    for magnitude in (1e-6, 1.0, 3e4):
        x = torch.randn(k, generator=torch.Generator().manual_seed(1)) * magnitude
        got = int4_gemv_split(x, qweight, scale, group, *config, True, **fp4)
        assert relative_error(got[0], x.double() @ w64.T) < TOLERANCE[torch.float16], magnitude
        wrong = int4_gemv_split(x, qweight, as_int4_words(scale, rows), group, *config, True)
        assert relative_error(wrong[0], x.double() @ w64.T) > 100 * TOLERANCE[torch.float16]
    rolled = int4_gemv_split(x, qweight, scale, group, *config, True, codes="fp4", row_scale=wrong_rows(rows)[1])
    assert relative_error(rolled[0], x.double() @ w64.T) > 100 * TOLERANCE[torch.float16]
    x = torch.randn(k, generator=torch.Generator().manual_seed(2)).half()
    residual = torch.randn(k, generator=torch.Generator().manual_seed(3)).half()
    norm_weight = torch.rand(k, generator=torch.Generator().manual_seed(4)).half() + 0.5
    got, summed = int4_gemv_split_rmsnorm(x, residual, norm_weight, 1e-6, qweight, scale, group, *config, True,
                                          **fp4)
    h = summed.double() * torch.rsqrt(summed.double().pow(2).mean() + 1e-6) * norm_weight.double()
    assert torch.equal(summed, (x.float() + residual.float()).half().reshape(summed.shape))
    assert relative_error(got[0], h.reshape(-1) @ w64.T) < TOLERANCE[torch.float16]
    if n % 2 == 0:
        swiglu = int4_gemv_split(x, qweight, scale, group, *config, True, swiglu_out=True, **fp4)
        product = int4_gemv_split(x, qweight, scale, group, *config, True, **fp4)
        assert torch.equal(swiglu, fused_ops.silu_and_mul(product))
    with pytest.raises(ValueError, match="e2m1 codes .* float16 sums only"):
        int4_gemv_split(x, qweight, scale, group, *config, **fp4)


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("n,k", [(10304, 2688), (2688, 4096), (3712, 2688), (2688, 3712), (4608, 2688),
                                 (6144, 4096), (4096, 14336)])
def test_gpu_split_gemv_reads_e2m1_codes_into_float16_pairs(n, k):
    """Nemotron-3-Nano's projections (K = 2688 and 3712 in padded splits) and two of Llama-3-8B's, NVFP4's groups
    of 16 and MXFP4's of 32: every start-up split form for e2m1 codes that takes the shape, bfloat16 and float16
    inputs, within their tolerance of float64."""
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split
    from shardserve.layers.quantization.int4 import split_forms

    failures = []
    for group in (16, 32):
        qweight, scale, rows = random_fp4(n, k, group, seed=group)
        w64 = reference_weight64("fp4", qweight, scale, group, rows)
        x = torch.randn(k, generator=torch.Generator(device=DEVICE).manual_seed(k), device=DEVICE)
        configs = [form for form in split_forms(k, group) if len(form) == 5]
        assert configs
        for config in configs:
            for dtype in (torch.bfloat16, torch.float16):
                got = int4_gemv_split(x.to(dtype), qweight, scale, group, *config, codes="fp4", row_scale=rows)
                torch.cuda.synchronize()
                error = relative_error(got[0].cpu(), x.to(dtype).double().cpu() @ w64.cpu().T)
                if not error < TOLERANCE[dtype]:
                    failures.append(f"fp4 {n}x{k} group {group} {config} {dtype}: error {error:.2g}")
    assert not failures, "\n".join(failures)


def test_a_negative_checkpoint_scale_is_folded_into_its_codes():
    """NVFP4 scales are e4m3 and may carry a sign; the kernels read scale bytes with the sign bit clear, so loading
    negates such a group's codes instead: the same products, exactly."""
    from shardserve.kernels.quant_pack import fp4_positive_scales, unpack_int4_rows

    qweight, scale, rows = random_fp4(seed=4)
    qweight, scale, rows = qweight.cpu(), scale.cpu(), rows.cpu()
    signed = scale.clone()
    signed[::3, 1] |= 0x80  # every third row's second group negative
    want = reference_weight64("fp4", qweight, signed, GROUP, rows)
    codes, positive = fp4_positive_scales(unpack_int4_rows(qweight), signed)
    assert int(positive.max()) < 0x80 and torch.equal(positive, scale)
    assert torch.equal(reference_weight64("fp4", pack_int4(codes), positive, GROUP, rows), want)
    assert not torch.equal(want, reference_weight64("fp4", qweight, scale, GROUP, rows))
