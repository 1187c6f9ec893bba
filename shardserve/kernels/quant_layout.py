"""The packed layouts' shape rules and word masks (the layouts: kernels/quant_pack.py's docstring), which the torch
dequantizers there and the Triton kernels both check against; this module imports neither.
"""

from __future__ import annotations

import torch

FOUR_BIT_KINDS = ("int4", "fp4")


# Low bits of a scale-and-zero word holding the zero point: GPTQ's zero points run 0..16 (stored minus one in the
# `gptq` checkpoint format, so 15 + 1), one more than four bits hold. The masks of its two parts (the Triton
# kernels read the words with the same ones: kernels/triton/quant_gemv.scale_and_zero).
ZERO_BITS = 5
ZERO_MASK = (1 << ZERO_BITS) - 1
SCALE_MASK = ~ZERO_MASK


def fp8_groups(k: int, group_k: int) -> int:
    """Scale columns of an fp8 weight with K input features: one per group of group_k (the last may be short)."""
    return -(-k // group_k)


def check_fp8(weight: torch.Tensor, scale: torch.Tensor, group_k: int) -> None:
    """Raise ValueError unless (weight, scale, group_k) is the fp8 layout (kernels/quant_pack.py's docstring)."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1:
        raise ValueError(f"fp8 weight must be a row-major 2-D torch.float8_e4m3fn tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    n, k = weight.shape
    if group_k < 1:
        raise ValueError(f"fp8 group_k must be positive, got {group_k}")
    groups = fp8_groups(k, group_k)
    if scale.dtype != torch.float32 or tuple(scale.shape) != (n, groups) or not scale.is_contiguous():
        raise ValueError(f"fp8 scale for weight {n}x{k} with group_k {group_k} must be contiguous float32 "
                         f"[{n}, {groups}], got {scale.dtype} {tuple(scale.shape)}")


def check_int4(qweight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, codes: str = "int4",
               row_scale: torch.Tensor | None = None) -> None:
    """Raise ValueError unless (qweight, scale_zero, group_size) is the int4 layout, or with codes="fp4" (qweight,
    scale bytes, group_size, row_scale) the fp4 one (kernels/quant_pack.py's docstring)."""
    if codes not in FOUR_BIT_KINDS:
        raise ValueError(f"4-bit codes are one of {', '.join(FOUR_BIT_KINDS)}, got {codes!r}")
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.stride(1) != 1:
        raise ValueError(f"{codes} qweight must be a row-major 2-D uint8 tensor [N, K // 2], got {qweight.dtype} "
                         f"{tuple(qweight.shape)} with strides {qweight.stride()}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if group_size < 2 or group_size % 2 or k % group_size:
        raise ValueError(f"{codes} group_size must be even and divide K={k}, got {group_size}")
    words = torch.uint8 if codes == "fp4" else torch.int32
    if scale_zero.dtype != words or tuple(scale_zero.shape) != (n, k // group_size) or not scale_zero.is_contiguous():
        what = "e4m3 scale bytes" if codes == "fp4" else "scale_zero (pack_scale_zero)"
        raise ValueError(f"{codes} {what} for K={k} with group_size {group_size} must be contiguous {words} "
                         f"[{n}, {k // group_size}], got {scale_zero.dtype} {tuple(scale_zero.shape)}")
    if codes == "fp4" and (row_scale is None or row_scale.dtype != torch.float32 or tuple(row_scale.shape) != (n,)
                           or not row_scale.is_contiguous()):
        found = "none" if row_scale is None else f"{row_scale.dtype} {tuple(row_scale.shape)}"
        raise ValueError(f"fp4 weights of {n} rows need their row scales, contiguous float32 [{n}], got {found}")
