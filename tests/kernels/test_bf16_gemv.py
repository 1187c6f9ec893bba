"""The bfloat16-weight CPU kernel computes x @ w^T like a float64 reference on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve.kernels import cpu_extensions
from shardserve.layers.linear_kernels import BF16DecodeKernel, build_linear_kernel


@pytest.fixture(scope="module")
def extension():
    ext = cpu_extensions.bf16_gemv()
    if ext is None:
        pytest.skip("the bfloat16 CPU kernel could not be built here (needs AVX2/FMA and a C++ compiler)")
    return ext


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("k", [576, 577, 64, 7])  # multiples of 32, of 8, and ragged tails
def test_matches_float64_reference(extension, rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(300, k, generator=g).to(torch.bfloat16)
    out = extension.bf16_weight_linear(x, w)
    ref = F.linear(x.double(), w.double())
    assert out.shape == (rows, 300)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_decode_kernel_single_row_and_batches_agree(extension):
    kernel, _ = build_linear_kernel("bf16-decode")
    assert isinstance(kernel, BF16DecodeKernel)
    w = torch.randn(256, 96).to(torch.bfloat16).float()  # values exactly representable in bfloat16
    bias = torch.randn(256)
    prepared = kernel.prepare(w)
    x = torch.randn(4, 96)
    batched = kernel(x, prepared, bias)
    single = torch.cat([kernel(x[i:i + 1], prepared, bias) for i in range(4)])
    ref = F.linear(x.double(), w.double(), bias.double())
    for out in (batched, single):
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
