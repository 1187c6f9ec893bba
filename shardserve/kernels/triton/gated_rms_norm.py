"""The gated output norms of the state-space mixers in one kernel, for a step's rows: per group of D features,

- Gated DeltaNet (layers/norm.GatedRMSNorm): RMSNorm of the delta rule's float32 output o, scaled by the weight
  (one [D] for every head), times silu(z): `gated_rms_norm`;
- Mamba-2 (layers/mamba2.GroupedGatedRMSNorm): RMSNorm of y * silu(z) over each group of heads, scaled by the
  weight of its features ([groups * D]): `grouped_gated_rms_norm`.

The torch forms take about eight launches a layer (the cast to the model's dtype, the square, the mean, the
rsqrt, two products, the sigmoid, the cast back); in a batch-1 decode step of Qwen3-Next those were about 0.4 ms
of 4.6. Program (row, group) reads the group's D values of o and of z once and writes its D outputs, rounding
where the torch form rounds: for Gated DeltaNet o to the model's dtype first, the normalised values before the
weight, the product after; for Mamba-2 the normalised values before the weight and the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def weight_normed(normed, w, out_dtype: tl.constexpr):
    """w * normed in out_dtype, the normalised values rounded to out_dtype before the weight, as the torch forms
    do; normed and w float32."""
    return (w * normed.to(out_dtype).to(tl.float32)).to(out_dtype)


@triton.jit
def norm_then_gate(x, z, w, eps, D: tl.constexpr, out_dtype: tl.constexpr):
    """Gated DeltaNet's norm of one head: (weight * norm(o)) * silu(z) in float32, from o's float32 values x [D_POW2]
    (zeros past D), rounded to out_dtype first, the normalised values rounded before the weight and the product
    after, as the torch form does; z and w float32."""
    x = x.to(out_dtype).to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    h = weight_normed(h, w, out_dtype).to(tl.float32)
    return h * z * tl.sigmoid(z)


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, weight_ptr, out_ptr, stride_o, stride_z, groups, weight_stride, eps,
                           D: tl.constexpr, D_POW2: tl.constexpr, GATE_FIRST: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = tl.arange(0, D_POW2)
    inside = cols < D
    out_dtype = out_ptr.dtype.element_ty
    x = tl.load(o_ptr + row * stride_o + group * D + cols, mask=inside, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + group * D + cols, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + group * weight_stride + cols, mask=inside, other=0.0).to(tl.float32)
    if GATE_FIRST:  # weight * norm(o * silu(z)), o unrounded
        h = x * z * tl.sigmoid(z)
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        out = weight_normed(h, w, out_dtype)
    else:  # (weight * norm(o)) * silu(z), o rounded to the output dtype first
        out = norm_then_gate(x, z, w, eps, D, out_dtype)
    tl.store(out_ptr + (row * groups + group) * D + cols, out.to(out_dtype), mask=inside)


def _launch(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
            weight_stride: int, gate_first: bool) -> torch.Tensor:
    """o [rows, features] (float32, unit stride within a row), z likewise (rows may be strided): out [rows,
    features] in weight's dtype, one program per row and group of group_size features."""
    rows, features = o.shape
    out = torch.empty(rows, features, dtype=weight.dtype, device=o.device)
    if rows == 0:
        return out
    if o.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError("the gated RMS norm needs o's and z's features unit-strided")
    groups = features // group_size
    _gated_rms_norm_kernel[(rows, groups)](o, z, weight, out, o.stride(0), z.stride(0), groups, weight_stride, eps,
                                           D=group_size, D_POW2=triton.next_power_of_2(group_size),
                                           GATE_FIRST=gate_first, num_warps=1 if group_size <= 128 else 4)
    return out


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet: o [rows, heads, D] (float32, rows contiguous), z [rows, heads * D] (rows may be strided,
    unit stride within), weight [D] in the model's dtype. Returns [rows, heads * D] in weight's dtype."""
    rows, heads, dim = o.shape
    if o.stride(2) != 1 or o.stride(1) != dim:
        raise ValueError("gated_rms_norm needs o's heads contiguous and z's features unit-strided")
    return _launch(o.view(rows, heads * dim), z, weight, eps, dim, 0, gate_first=False)


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                           eps: float) -> torch.Tensor:
    """Mamba-2: y [rows, features] float32, z [rows, features] (rows may be strided, unit stride within), weight
    [features] in the model's dtype; the RMS over each group of group_size features apart. Returns [rows,
    features] in weight's dtype."""
    return _launch(y, z, weight, eps, group_size, group_size, gate_first=True)
