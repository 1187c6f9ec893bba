"""The packed "fp4" layout (kernels/quant_pack.py: e2m1 codes in int4's nibbles, a float32 scale word a group) through
the 4-bit kernels' e2m1 decode table: the torch dequantizer is exact against the float64 definition, and in Triton's
interpreter (tiny shapes) the tiled GEMV, the split-K GEMV's float16 sums, the GEMM and the dequantize kernel agree
with it; the same kernels with the int4 table, or a layer dequantizing with it, fail the start-up check. On a GPU,
the split-K GEMV's paired instructions on Nemotron-3-Nano's and Llama-3-8B's shapes."""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from shardserve.kernels.quant_pack import (E2M1_VALUES, dequantize_int4, pack_fp4_scales, pack_int4,  # noqa: E402
                                           reference_weight64)
from shardserve.kernels.self_check import TOLERANCE, relative_error  # noqa: E402
from shardserve.layers.quantization.check import check_packed  # noqa: E402
from shardserve.layers.quantization.packed import PackedLayout, PackedWeights  # noqa: E402
from tests.helpers.kernels import CUDA, DEVICE, packed_layer  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
N, K, GROUP = 24, 64, 16  # a partial row tile for block_n 16, four groups a row


def random_fp4(n: int = N, k: int = K, group: int = GROUP, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed e2m1 codes [n, k / 2], scale words [n, k / group]): every code, scales as NVFP4's are (an e4m3 value
    times a global scale, in float32)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    e4m3 = (torch.rand(n, k // group, generator=g) * 448).to(torch.float8_e4m3fn).float()
    return pack_int4(codes).to(DEVICE), pack_fp4_scales(e4m3 * 1.7e-4).to(DEVICE)


def test_the_e2m1_table_and_the_torch_dequantizer_are_the_definition():
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert all(E2M1_VALUES[8 + i] == -E2M1_VALUES[i] for i in range(8))
    qweight, words = random_fp4()
    want = reference_weight64("fp4", qweight, words, GROUP)
    # float64's product is exact; float32's is it rounded once.
    assert torch.equal(dequantize_int4(qweight, words, GROUP, torch.float32, codes="fp4"), want.float())
    # One byte: column 0 in the low nibble (code 3 = 1.5), column 1 in the high one (code 13 = -3).
    one = reference_weight64("fp4", torch.tensor([[0xD3]], dtype=torch.uint8), pack_fp4_scales(torch.ones(1, 1)), 2)
    assert one.tolist() == [[1.5, -3.0]]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreter_gemv_and_dequantize_decode_e2m1(dtype):
    from shardserve.kernels.triton.quant_gemv import dequantize_int4_cuda, int4_gemv

    qweight, words = random_fp4()
    x = torch.randn(K, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    want = x.double().cpu() @ reference_weight64("fp4", qweight, words, GROUP).cpu().T
    got = int4_gemv(x, qweight, words, GROUP, 16, 32, num_warps=4, num_stages=1, codes="fp4")
    assert relative_error(got[0], want) < TOLERANCE[dtype]
    # The same kernel with the int4 table (integers minus a zero point read from the scale's low bits) is wrong.
    wrong = int4_gemv(x, qweight, words, GROUP, 16, 32, num_warps=4, num_stages=1, codes="int4")
    assert relative_error(wrong[0], want) > 100 * TOLERANCE[dtype]
    dequantized = dequantize_int4_cuda(qweight, words, GROUP, dtype, block_r=8, block_c=16, codes="fp4")
    assert torch.equal(dequantized, dequantize_int4(qweight.cpu(), words.cpu(), GROUP, dtype, codes="fp4").to(DEVICE))


@needs_triton
def test_interpreter_gemm_decodes_e2m1():
    from shardserve.kernels.triton.quant_gemm import GemmConfig, int4_gemm

    qweight, words = random_fp4(seed=2)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    got = int4_gemm(x, qweight, words, GROUP, GemmConfig(16, 16, 16, 4, 1), codes="fp4")
    want = x.double().cpu() @ reference_weight64("fp4", qweight, words, GROUP).cpu().T
    assert relative_error(got, want) < TOLERANCE[torch.float16]


def test_the_start_up_check_fails_a_layer_that_decodes_fp4_with_the_int4_table(monkeypatch):
    """check_packed compares every packed shape with the float64 definition: a packed fp4 layer passes, and the same
    layer whose products dequantize with the int4 table is reported."""
    model = nn.ModuleList([packed_layer(N, K, PackedLayout("fp4", GROUP), torch.float32)])
    assert check_packed(model) == []
    int4_table = lambda self, layer, dtype: dequantize_int4(layer.weight, layer.weight_scale, self.group, dtype)  # noqa: E731
    monkeypatch.setattr(PackedWeights, "dequantized", int4_table)
    failures = check_packed(model)
    assert failures and all(f.startswith("fp4") for f in failures)


# Several splits and row tiles with rows past N; splits of 48 and 112 columns, held padded to 64 and 128.
SPLIT_CASES = [(24, 64, 16, (16, 64, 4, 1)), (19, 192, 32, (8, 64, 4, 3)), (40, 512, 16, (16, 256, 4, 2)),
               (24, 96, 16, (16, 48, 4, 1)), (19, 112, 16, (8, 112, 4, 2))]


@needs_triton
@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs real ones below")
@pytest.mark.parametrize("n,k,group,config", SPLIT_CASES)
def test_interpreter_split_gemv_reads_e2m1_codes_into_float16_pairs(n, k, group, config):
    """Every code in every nibble position, inputs from 1e-6 to 3e4 (each program scales x by its own power of two),
    the norm inside, SwiGLU out, several splits and row tiles with rows past N: within float16's tolerance of
    float64; the same kernel reading the codes as int4 nibbles is wrong; float32 sums are refused for e2m1 codes."""
    from shardserve.kernels.triton import fused_ops
    from shardserve.kernels.triton.quant_gemv import int4_gemv_split, int4_gemv_split_rmsnorm

    qweight, words = random_fp4(n, k, group, seed=n)
    w64 = reference_weight64("fp4", qweight, words, group).cpu()
    for magnitude in (1e-6, 1.0, 3e4):
        x = torch.randn(k, generator=torch.Generator().manual_seed(1)) * magnitude
        got = int4_gemv_split(x, qweight, words, group, *config, True, codes="fp4")
        assert relative_error(got[0], x.double() @ w64.T) < TOLERANCE[torch.float16], magnitude
        wrong = int4_gemv_split(x, qweight, words, group, *config, True)
        assert relative_error(wrong[0], x.double() @ w64.T) > 100 * TOLERANCE[torch.float16]
    x = torch.randn(k, generator=torch.Generator().manual_seed(2)).half()
    residual = torch.randn(k, generator=torch.Generator().manual_seed(3)).half()
    norm_weight = torch.rand(k, generator=torch.Generator().manual_seed(4)).half() + 0.5
    got, summed = int4_gemv_split_rmsnorm(x, residual, norm_weight, 1e-6, qweight, words, group, *config, True,
                                          codes="fp4")
    h = summed.double() * torch.rsqrt(summed.double().pow(2).mean() + 1e-6) * norm_weight.double()
    assert torch.equal(summed, (x.float() + residual.float()).half().reshape(summed.shape))
    assert relative_error(got[0], h.reshape(-1) @ w64.T) < TOLERANCE[torch.float16]
    if n % 2 == 0:
        swiglu = int4_gemv_split(x, qweight, words, group, *config, True, swiglu_out=True, codes="fp4")
        product = int4_gemv_split(x, qweight, words, group, *config, True, codes="fp4")
        assert torch.equal(swiglu, fused_ops.silu_and_mul(product))
    with pytest.raises(ValueError, match="e2m1 codes .* float16 sums only"):
        int4_gemv_split(x, qweight, words, group, *config, codes="fp4")


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
        qweight, words = random_fp4(n, k, group, seed=group)
        w64 = reference_weight64("fp4", qweight, words, group)
        x = torch.randn(k, generator=torch.Generator(device=DEVICE).manual_seed(k), device=DEVICE)
        configs = [form for form in split_forms(k, group) if len(form) == 5]
        assert configs
        for config in configs:
            for dtype in (torch.bfloat16, torch.float16):
                got = int4_gemv_split(x.to(dtype), qweight, words, group, *config, codes="fp4")
                torch.cuda.synchronize()
                error = relative_error(got[0].cpu(), x.to(dtype).double().cpu() @ w64.cpu().T)
                if not error < TOLERANCE[dtype]:
                    failures.append(f"fp4 {n}x{k} group {group} {config} {dtype}: error {error:.2g}")
    assert not failures, "\n".join(failures)
