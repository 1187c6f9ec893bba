"""Gated DeltaNet's output norm in one Triton kernel equals the torch form (GatedRMSNorm on the delta rule's output
rounded to the model's dtype, gated by silu(z)) for float32 and bfloat16, odd head widths and z read in place from
the wider projection output.

On a machine without CUDA the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from shardserve.kernels.triton.gated_rms_norm import gated_rms_norm  # noqa: E402
from shardserve.layers.norm import GatedRMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, dim", [(4, 16), (3, 24), (2, 128)])
def test_the_fused_gated_norm_equals_the_torch_form(dtype, heads, dim):
    g = torch.Generator().manual_seed(dim + heads)
    rows = 5
    norm = GatedRMSNorm(dim, 1e-6, dtype).to(DEVICE)
    norm.weight.data = (0.5 + torch.rand(dim, generator=g)).to(dtype).to(DEVICE)
    o = (torch.randn(rows, heads, dim, generator=g) * 3).to(DEVICE)
    projected = torch.randn(rows, 7 + heads * dim, generator=g).to(dtype).to(DEVICE)
    z = projected[:, 7:]  # a view with the projection's row stride, as forward splits it
    expected = norm(o.to(dtype), z.reshape(rows, heads, dim)).reshape(rows, -1)
    out = gated_rms_norm(o, z, norm.weight, norm.eps)
    assert out.dtype == dtype and out.shape == (rows, heads * dim)
    # bfloat16: the two forms round the same values at the same places, but a last-bit difference in the norm
    # can round a value to its neighbour, which the weight and the gate then scale (a few bfloat16 steps).
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(out, expected, **tol)
