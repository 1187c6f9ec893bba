"""Layouts of quantized weights, and turning them back into dense matrices, in plain torch (CPU or CUDA).

Two layouts, both row-major over the output features N and the input features K:
- fp8: weight float8_e4m3fn [N, K], scale float32 [N, ceil(K / group_k)],
  W[n, k] = float(weight[n, k]) * scale[n, k // group_k]. group_k >= K means one scale per row.
- int4: qweight uint8 [N, K // 2], byte j of a row holding column 2j in its low nibble and 2j + 1 in its high
  one (values 0..15); scale_zero int32 [N, K // group_size], a group's scale and zero point in one word
  (pack_scale_zero): the float32 scale's bits with its low ZERO_BITS bits replaced by the zero point (0..31);
  W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with g = k // group_size.
  One word a group is half the bytes of two float32 tensors and one load instead of two in every kernel; the
  scale keeps 18 of float32's 23 mantissa bits, so checkpoints' float16 and bfloat16 scales are exact.
- fp4: 4-bit floats (NVFP4, MXFP4 checkpoints: weights/fp4.py): qweight as int4's, holding e2m1 codes (0, 0.5,
  1, 1.5, 2, 3, 4, 6, bit 3 the sign) in the same nibbles; scale uint8 [N, K // group_size], each group's
  float8_e4m3fn bits, sign bit clear (fp4_positive_scales); row_scale float32 [N]:
  W[n, k] = e2m1(q[n, k]) * float32(e4m3(scale[n, g]) * row_scale[n]).
  These are NVFP4's own two levels (an e4m3 scale a group of 16, a float32 global scale), the global scale kept a
  row so that fused q/k/v and gate/up rows each keep their own part's: 9 bytes carry 16 weights, where a float32
  scale word took 12. The group scale rounds once to float32, as the checkpoint reader's does, and e2m1(q) * scale
  once more: the dequantizers give the reader's bits.
The dequantizers compute W in float32 and round once to the requested dtype, so every backend that does the
same gives the same bits. This module imports no Triton: the CUDA kernel behind dequantize_int4 is loaded
only when a CUDA tensor asks for it.
"""

from __future__ import annotations

import torch

from shardserve.kernels.quant_layout import SCALE_MASK, ZERO_BITS, ZERO_MASK, check_fp8, check_int4

# e2m1 values of the codes 0..15 (fp4 layout): the code's magnitude in bits 0-2, its sign in bit 3.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 (K even) -> uint8 [N, K // 2], column 2j in the low nibble of byte j."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4 needs a 2-D tensor with an even number of columns, got {tuple(q.shape)}")
    if q.is_floating_point() or q.is_complex():
        raise ValueError(f"pack_int4 needs integers in 0..15, got dtype {q.dtype}")
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError(f"pack_int4 needs values in 0..15, got {q.min().item()}..{q.max().item()}")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] from pack_int4 -> uint8 [N, K] of values 0..15."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4_rows needs a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def pack_scale_zero(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float scales and whole-number zero points (same shape) -> the int4 layout's int32 words: the scale rounded to
    float32 with 18 mantissa bits (to nearest; exact for float16 and bfloat16 scales), its low ZERO_BITS bits then
    holding the zero point."""
    if scale.shape != zero.shape:
        raise ValueError(f"scales {tuple(scale.shape)} and zero points {tuple(zero.shape)} differ in shape")
    zero = zero.to(torch.int32)
    if zero.numel() and (zero.min() < 0 or zero.max() > ZERO_MASK):
        raise ValueError(f"int4 zero points must lie in 0..{ZERO_MASK}, got {zero.min().item()}..{zero.max().item()}")
    half = 1 << (ZERO_BITS - 1)
    bits = (scale.float().contiguous().view(torch.int32) + half) & SCALE_MASK
    return bits | zero


def unpack_scale_zero(scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 scale-and-zero words -> (scales, zero points), both float32."""
    return (scale_zero & SCALE_MASK).view(torch.float32), (scale_zero & ZERO_MASK).float()


def scale_dtype(kind: str) -> torch.dtype:
    """The dtype of a packed layout's scale tensor: float32 scales for "fp8", int32 words for "int4" (scale and
    zero), e4m3 bytes (uint8) for "fp4"."""
    return {"int4": torch.int32, "fp4": torch.uint8}.get(kind, torch.float32)


def fp4_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn group scales -> the fp4 layout's scale bytes (their bits)."""
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp4 group scales are float8_e4m3fn, got {scale.dtype}")
    return scale.contiguous().view(torch.uint8)


def fp4_positive_scales(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 codes [N, K] in 0..15, e4m3 scale bytes [N, K / group]) with every negative scale made positive and
    its group's codes negated (bit 3 flipped): the same products, exactly, and the sign bit clear that the kernels'
    decode (quant_gemv.e4m3_scale_units) assumes."""
    negative = scale >= 0x80
    if not bool(negative.any()):
        return codes, scale
    group = codes.shape[1] // scale.shape[1]
    flips = negative.repeat_interleave(group, dim=1).to(torch.uint8) << 3
    return codes ^ flips, scale & 0x7F


def fp4_scales(scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The fp4 layout's scale bytes [..., N, G] and row scales [..., N] -> float32 group scales, rounded once."""
    return scale.view(torch.float8_e4m3fn).float() * row_scale.float()[..., None]


def quantize_fp4(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> the fp4 layout (packed e2m1 codes uint8 [N, K / 2], e4m3 scale bytes [N, K / group], row
    scales float32 [N]) as NVFP4 quantizes: a row's scale puts its largest magnitude at e2m1's largest value (6)
    times e4m3's (448), each group's e4m3 scale its own largest at 6, each value rounded to the nearest code."""
    n, k = values.shape
    blocks = values.float().reshape(n, -1, group)
    tiny = torch.finfo(torch.float32).tiny
    row_scale = (blocks.abs().amax(dim=(1, 2)) / (6 * 448)).clamp(min=tiny)
    group_scale = (blocks.abs().amax(dim=2) / 6 / row_scale[:, None]).to(torch.float8_e4m3fn)
    scale = fp4_scale_bytes(group_scale)
    full = fp4_scales(scale, row_scale).clamp(min=tiny)
    table = torch.tensor(E2M1_VALUES, device=values.device)
    codes = (blocks / full[:, :, None]).unsqueeze(-1).sub(table).abs().argmin(dim=-1)
    return pack_int4(codes.reshape(n, k)), scale, row_scale


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 e2m1 values of 4-bit codes (integers 0..15)."""
    return torch.tensor(E2M1_VALUES, device=codes.device)[codes.long()]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, group_k: int, dtype: torch.dtype) -> torch.Tensor:
    """fp8 weight [N, K] and its scales -> dense [N, K] in dtype (float32 products, rounded once)."""
    check_fp8(weight, scale, group_k)
    n, k = weight.shape
    groups = scale.shape[1]
    w = weight.float()
    if groups == 1:
        return (w * scale).to(dtype)
    padded = groups * group_k
    if padded != k:
        w = torch.nn.functional.pad(w, (0, padded - k))
    return (w.view(n, groups, group_k) * scale[:, :, None]).view(n, padded)[:, :k].to(dtype)


def dequantize_int4(qweight: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype, codes: str = "int4", row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit qweight [N, K // 2] with its scales -> dense [N, K] in dtype: (q - zero) * scale for codes "int4",
    e2m1(q) * float32(e4m3 scale * row_scale) for "fp4", in float32 rounded once. One Triton launch on CUDA, torch
    ops elsewhere; both give the same bits."""
    check_int4(qweight, scale_zero, group_size, codes, row_scale)
    if qweight.is_cuda:
        from shardserve.kernels.triton.quant_gemv import dequantize_int4_cuda

        return dequantize_int4_cuda(qweight, scale_zero, group_size, dtype, codes=codes, row_scale=row_scale)
    n, groups = scale_zero.shape
    if codes == "fp4":
        values = e2m1_decode(unpack_int4_rows(qweight)).view(n, groups, group_size)
        return (values * fp4_scales(scale_zero, row_scale)[:, :, None]).view(n, groups * group_size).to(dtype)
    scale, zero = unpack_scale_zero(scale_zero)
    q = unpack_int4_rows(qweight).float().view(n, groups, group_size)
    return ((q - zero[:, :, None]) * scale[:, :, None]).view(n, groups * group_size).to(dtype)


def reference_weight64(kind: str, weight: torch.Tensor, scale: torch.Tensor, group: int,
                       row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [N, K] of a packed weight ("fp8": codes and scales; "int4": packed nibbles and scale-and-zero words;
    "fp4": packed e2m1 codes, e4m3 scale bytes and row scales), written from the layouts' definitions above rather
    than by the dequantizers: what the start-up checks compare every kernel with. group: columns a scale covers (the
    last fp8 group may be short)."""
    if kind == "fp8":
        return weight.float().double() * scale.double().repeat_interleave(group, dim=1)[:, :weight.shape[1]]
    if kind == "fp4":
        table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=weight.device)
        codes = torch.stack((weight & 15, weight >> 4), dim=-1).reshape(weight.shape[0], -1)
        e4m3 = scale.view(torch.float8_e4m3fn).double()
        group_scale = (e4m3 * row_scale.double()[:, None]).float().double()  # rounded to float32 once, by definition
        return table[codes.long()] * group_scale.repeat_interleave(group, dim=1)
    scale, zero = unpack_scale_zero(scale)
    q = unpack_int4_rows(weight).double()
    return (q - zero.double().repeat_interleave(group, dim=1)) * scale.double().repeat_interleave(group, dim=1)


def fit_block_k(block_k: int, group: int, k: int) -> int:
    """A packed GEMM's reduction depth: block_k narrowed to the largest power of two dividing the scale group, so
    that a tile needs one scale a row (any depth where one group spans all k columns). ValueError below 16,
    tl.dot's smallest."""
    if group >= k:
        return block_k
    fitted = min(block_k, group & -group)
    if fitted < 16:
        raise ValueError(f"packed GEMMs need scale groups of a multiple of 16 columns, got {group}")
    return fitted
