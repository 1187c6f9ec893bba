"""The Triton decode step of a Mamba-2 layer equals the torch one: the same SSM output and the same states left in
the same pool slots, for one and two B/C groups, masked head and state sizes, with and without the convolution's
bias and a time-step limit, SSM states kept in float32 or bfloat16; a row with slot -1 (a CUDA graph's padding
row) reads and writes no slot. The grouped gated norm in one kernel equals its torch form.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.layers.mamba2_kernels import TorchMamba2Kernels, TritonDecodeMamba2Kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = 5
HEADS, HEAD_DIM, STATE, KERNEL = 4, 12, 10, 4  # head_dim and state_size below their powers of two: masked lanes


def _inputs(groups: int, ssm_dtype: torch.dtype, bias: bool, limit: tuple[float, float], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    channels = HEADS * HEAD_DIM + 2 * groups * STATE

    def rand(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    # xbc and dt as views into wider rows, as they come out of the fused input projection.
    projected = rand(4, 3 + channels + HEADS)
    return dict(xbc=projected[:, 3:3 + channels], dt=projected[:, 3 + channels:],
                conv_weight=rand(channels, KERNEL, scale=0.5), conv_bias=rand(channels) if bias else None,
                a_log=rand(HEADS, scale=0.5), d=rand(HEADS), dt_bias=rand(HEADS, scale=0.5), time_step_limit=limit,
                groups=groups, conv_pool=rand(SLOTS, channels, KERNEL - 1),
                ssm_pool=rand(SLOTS, HEADS, HEAD_DIM, STATE, dt=ssm_dtype))


def _step(kernels, inputs: dict, rows: list[int], slots: list[int]):
    pools = {name: inputs[name].clone() for name in ("conv_pool", "ssm_pool")}
    picked = {name: inputs[name][rows] for name in ("xbc", "dt")}
    y = kernels.step_in_pool(**{**inputs, **pools, **picked}, slots=torch.tensor(slots, device=DEVICE))
    return y, pools["conv_pool"], pools["ssm_pool"]


@pytest.mark.parametrize("groups, ssm_dtype, bias, limit", [
    (1, torch.float32, True, (0.0, float("inf"))),
    (2, torch.float32, False, (0.05, 0.8)),  # the limit clamps some heads' steps on both sides
    (2, torch.bfloat16, True, (0.0, float("inf"))),  # states stored rounded, stepped in float32
])
def test_triton_decode_step_equals_torch_and_skips_padding_rows(groups, ssm_dtype, bias, limit):
    inputs = _inputs(groups, ssm_dtype, bias, limit, seed=groups)
    slots = [3, -1, 0, 2]
    y, conv, ssm = _step(TritonDecodeMamba2Kernels, inputs, [0, 1, 2, 3], slots)
    live = [0, 2, 3]
    ref_y, ref_conv, ref_ssm = _step(TorchMamba2Kernels, inputs, live, [slots[r] for r in live])
    tol = dict(atol=1e-5, rtol=1e-5) if ssm_dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(y[live], ref_y, **tol)
    torch.testing.assert_close(conv, ref_conv, atol=0, rtol=0)  # the convolution state is a copy of inputs
    torch.testing.assert_close(ssm.float(), ref_ssm.float(), **tol)
    for slot in (1, 4):  # no row's, and the padding row's slot -1 read as the last
        assert torch.equal(ssm[slot], inputs["ssm_pool"][slot]) and torch.equal(conv[slot], inputs["conv_pool"][slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_grouped_gated_norm_equals_the_torch_form(dtype):
    g = torch.Generator().manual_seed(5)
    rows, groups, group_size = 3, 2, 24  # a group of three heads of 8: not a power of two
    weight = (0.5 + torch.rand(groups * group_size, generator=g)).to(dtype).to(DEVICE)
    y = (torch.randn(rows, groups * group_size, generator=g) * 3).to(DEVICE)
    projected = torch.randn(rows, 5 + groups * group_size, generator=g).to(dtype).to(DEVICE)
    z = projected[:, 5:]  # a view with the projection's row stride, as forward splits it
    expected = TorchMamba2Kernels.norm(y, z, weight, group_size, 1e-5)
    out = TritonDecodeMamba2Kernels.norm(y, z, weight, group_size, 1e-5)
    assert out.dtype == dtype and out.shape == (rows, groups * group_size)
    # bfloat16: both round the normalised values, then the product; a last-bit difference in the norm can round a
    # value to its neighbour, which the weight then scales.
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tol)
