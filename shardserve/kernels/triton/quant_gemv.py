"""Single-token GEMVs over quantized weights (fp8 with scales, int4 with scales and zero points), and the int4
dequantizer that batches use. Layouts: shardserve.kernels.quant_pack.

As in gemv.py, a decode step reads every weight once, so each launch streams the weights with an evict-first
hint, each program owning BLOCK_N output rows and walking K in tiles with float32 partial sums, one launch per
product. A tile of BLOCK_K columns is split into TILE_GROUPS sub-tiles of SUB columns, SUB a power of two
that divides the quantization group, so each sub-tile lies inside one group and needs one scale (and zero)
per row: a tile may span several groups without per-element scale lookups. With one group per row
(per-channel), the scale is applied once after the reduction instead.

4-bit weights also have a GEMV split over K (_int4_split_gemv_kernel, int4_gemv_split): x's slice held in
registers (or, for splits wider than INT4_SPLIT_CHUNK columns, walked chunk by chunk), nibbles read as float32
denormals, partial sums summed by each row block's last program (one split: each program stores its rows);
start-up timing (layers/quantization/gemv_choice.py) picks it or the tiled one per shape. A 4-bit group's scale and
zero point come from one word (scale_and_zero).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.quant_layout import FOUR_BIT_KINDS, SCALE_MASK, ZERO_MASK, check_fp8, check_int4, fp8_groups
from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.arrivals import ARRIVAL_SLOTS, arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.pdl import enter
from shardserve.kernels.triton.gemv import (normed_row_args, normed_values, output_rows, preload_tiles, program_rows,
                                            rms_of_sum, store_rows)


@triton.jit
def _e4m3_bits_to_float(b):
    """float8_e4m3fn bits (uint8) -> the value / 256 in float32, for GPUs without fp8 conversions: the seven
    magnitude bits shifted into a float16 land on its exponent and mantissa (subnormals included) with the
    exponent bias off by 8. The NaN code (0x7f) decodes to 480 / 256; weights hold no NaN."""
    b = b.to(tl.int32)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# Masks of an int4 scale-and-zero word (kernels/quant_pack.py): the scale's bits, and the zero point's.
_SCALE_MASK = tl.constexpr(SCALE_MASK)
_ZERO_MASK = tl.constexpr(ZERO_MASK)


@triton.jit
def scale_and_zero(words):
    """(scale, zero point) as float32 from int4 scale-and-zero words: the scale is the word with its low ZERO_BITS
    bits cleared, the zero point those bits."""
    return (words & _SCALE_MASK).to(tl.float32, bitcast=True), (words & _ZERO_MASK).to(tl.float32)


@triton.jit
def four_bit_scale_and_zero(words, FP4: tl.constexpr, row_scale=1.0):
    """(scale, zero point) of 4-bit scales: scale_and_zero's for int4's words; for fp4's e4m3 bytes their value
    times the row's scale (row_scale, shaped to broadcast), rounded once as the layout defines, and zero points 0
    (quant_pack's fp4 layout)."""
    # One return of one type a form: Triton checks every return of a function against the first, constexpr
    # branches not taken included.
    if FP4:
        scale = e4m3_scale_units(words) * FP4_SCALE_UNIT * row_scale  # the exact value, then one rounding
        zero = tl.zeros_like(scale)
    else:
        scale, zero = scale_and_zero(words)
    return scale, zero


# fp4's scale bytes decode to their value over this (e4m3_scale_units).
FP4_SCALE_UNIT = tl.constexpr(256.0)


@triton.jit
def e4m3_scale_units(words):
    """fp4's e4m3 scale bytes as float32, their value / FP4_SCALE_UNIT exactly: the seven bits (the sign bit is
    clear: quant_pack.fp4_positive_scales folds a negative scale into its group's codes at load) shifted onto a
    float16's exponent and mantissa, subnormals included, with the exponent bias off by 8. A shift and a conversion
    a group, where the sign's bits and a float32 decode took six."""
    return (words.to(tl.int32) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def four_bit_row_scales(rs_ptr, rows, row_ok, FP4: tl.constexpr):
    """fp4's scales of `rows` (float32, 0 where not row_ok); 1.0 for int4, which has none."""
    if FP4:
        scales = tl.load(rs_ptr + rows, mask=row_ok, other=0.0)
    else:
        scales = 1.0
    return scales


# An e2m1 code's three magnitude bits placed at float32 bits 22-24 are a float32 of exactly its value times
# 2 ** -126: exponent bits e give 2 ** (e - 127) * (1 + m / 2) for e > 0 (e2m1's 2 ** (e - 1) * (1 + m / 2)), and
# for e = 0 the subnormal m * 2 ** -127 (e2m1's m / 2).
E2M1_SUBNORMAL_SCALE = tl.constexpr(2.0 ** 126)


@triton.jit
def nibble_values(nibbles, FP4: tl.constexpr):
    """float32 values of 4-bit codes (int32 in 0..15): the integer (int4), or its e2m1 value (fp4, bit 3 the sign):
    the code's bits moved into a float32 (E2M1_SUBNORMAL_SCALE) and scaled by a power of two, exact, five integer
    operations and a multiply a weight."""
    if FP4:
        bits = ((nibbles & 7) << 22) | ((nibbles & 8) << 28)
        return bits.to(tl.float32, bitcast=True) * E2M1_SUBNORMAL_SCALE
    return nibbles.to(tl.float32)


# Per-row FP8 GEMVs may keep their partial sums in float16 pairs (F16_SUMS): x enters scaled by this power of two, so
# a lane's sum of up to 28 tiles of e4m3 products (448 at most) stays finite for |x| up to about 1,300; a row whose
# sum is not finite anyway is summed again in float32, so an overflow never reaches the output.
F16_X_SCALE = tl.constexpr(1.0 / 256)


@triton.jit
def _f16_products(acc, w, x):
    """acc + w * x in float16 pairs, acc and x float16 and w e4m3 bytes (uint8) of one shape: each 32-bit word of
    four weights is two conversions to float16 pairs and two paired multiply-adds, one instruction each (the float32
    path takes about three a weight: a conversion, a widening and a multiply-add)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        fma.rn.f16x2 $0, a, $3, $5;
        fma.rn.f16x2 $1, b, $4, $6;
        }""",
        "=r,=r,r,r,r,r,r", [w, x, acc], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, stride_wn, residual_ptr, norm_w_ptr, sum_ptr, eps,
                     K: tl.constexpr, GROUP_K: tl.constexpr, PER_ROW: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr, SUB: tl.constexpr, NORM: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr = 0,
                     SWIGLU_OUT: tl.constexpr = False, F16_SUMS: tl.constexpr = False,
                     F16_ASM: tl.constexpr = False, SHARED_SCALES: tl.constexpr = False,
                     GROUPS_P: tl.constexpr = 1):
    """out[n] = sum_k float(w[n, k]) * s[n, k // GROUP_K] * x[k]. SUB divides GROUP_K unless PER_ROW (one scale
    per row, applied after the reduction). w points at the raw bytes (masked loads of uint8 can fill with 0),
    reinterpreted as float8e4nv with NATIVE_FP8 and decoded bit by bit without it. With NORM, x is RMSNorm(x +
    residual) computed on the fly as gemv.py's norm-fused GEMV computes it (program 0 stores the sum). PDL and
    PRELOAD (0 or 1 tile of weights loaded before the wait), SWIGLU_OUT (out = silu(gate) * up of a [gate | up]
    weight of 2N rows): as in gemv.py.
    F16_SUMS (PER_ROW only): each lane's products summed over the tiles in float16 (F16_X_SCALE), then in float32;
    with F16_ASM (native FP8 on a GPU) by paired instructions (_f16_products), half the float32 path's instructions
    a weight, for GPUs whose memory outruns their SMs' issue.
    SHARED_SCALES (groups, F16_SUMS, not SWIGLU_OUT): the program's BLOCK_N rows share their group scales (a
    block-scaled checkpoint's 128-row blocks: the caller knows, fp8_gemv's rows_share_scales), so x enters each
    group times the group's scale over the row's largest (GROUPS_P: a power of two >= the groups), keeping x's
    range for the float16 sums whatever the scales' magnitude, and the rows are summed as one scale a row's, that
    largest scale applied after."""
    tl.static_assert(not SHARED_SCALES or (F16_SUMS and not SWIGLU_OUT and not PER_ROW),
                     "shared scales: float16 sums of groups, rows of one half")
    BLOCK_K: tl.constexpr = TILE_GROUPS * SUB
    NUM_GROUPS: tl.constexpr = (K + GROUP_K - 1) // GROUP_K
    rows, row_ok = program_rows(tl.program_id(0), N, BLOCK_N, SWIGLU_OUT)
    sub = tl.arange(0, TILE_GROUPS)
    cols = sub[:, None] * SUB + tl.arange(0, SUB)[None, :]
    w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * stride_wn
    s_rows = s_ptr + rows.to(tl.int64)[:, None] * NUM_GROUPS
    if PRELOAD:
        first = _fp8_weight_tile(w_rows, 0, cols, row_ok, K, BLOCK_K)  # no kernel of the chain writes weights
    if PER_ROW and not NORM:  # nor scales: off the tail of the program (with the norm inside: 1 us slower, H200)
        row_scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    # The scale row every row of the program shares (SHARED_SCALES): its first row's, and its largest scale, read
    # before the wait too, so that the first tile's sums do not wait for a round trip to memory after it.
    s_shared = s_ptr + (tl.program_id(0) * BLOCK_N).to(tl.int64) * NUM_GROUPS
    s_max = 1.0
    if SHARED_SCALES:
        groups = tl.arange(0, GROUPS_P)
        s_max = tl.maximum(tl.max(tl.load(s_shared + groups, mask=groups < NUM_GROUPS, other=0.0), axis=0), 1e-30)
    enter(PDL)
    rstd = 0.0
    if NORM:
        rstd = rms_of_sum(x_ptr, residual_ptr, sum_ptr, eps, tl.program_id(0) == 0, K, BLOCK_K, HAS_RESIDUAL)
    acc = tl.zeros((BLOCK_N, TILE_GROUPS, SUB), dtype=tl.float16 if F16_SUMS else tl.float32)
    if PRELOAD:
        acc = _fp8_tile_products(acc, first, 0, x_ptr, residual_ptr, norm_w_ptr, rstd, s_rows, row_ok, sub, cols,
                                 K, GROUP_K, NUM_GROUPS, PER_ROW, NATIVE_FP8, SUB, BLOCK_K, NORM, HAS_RESIDUAL,
                                 F16_SUMS, F16_ASM, SHARED_SCALES, s_shared, 1.0 / s_max)
    for k in range(PRELOAD * BLOCK_K, K, BLOCK_K):
        w = _fp8_weight_tile(w_rows, k, cols, row_ok, K, BLOCK_K)
        acc = _fp8_tile_products(acc, w, k, x_ptr, residual_ptr, norm_w_ptr, rstd, s_rows, row_ok, sub, cols,
                                 K, GROUP_K, NUM_GROUPS, PER_ROW, NATIVE_FP8, SUB, BLOCK_K, NORM, HAS_RESIDUAL,
                                 F16_SUMS, F16_ASM, SHARED_SCALES, s_shared, 1.0 / s_max)
    y = tl.sum(tl.sum(acc.to(tl.float32), axis=2), axis=1)
    if F16_SUMS:
        y *= 256.0  # the float16 products are the weights' values times x / 256, native or decoded
        if SHARED_SCALES:
            y *= s_max
        if tl.max(tl.where(tl.abs(y) < float("inf"), 0, 1), axis=0) > 0:  # an overflow (or NaN): again in float32
            y = _fp8_float32_sums(w_rows, x_ptr, residual_ptr, norm_w_ptr, rstd, s_rows, row_ok, sub, cols, K,
                                  GROUP_K, NUM_GROUPS, PER_ROW, NATIVE_FP8, BLOCK_N, TILE_GROUPS, SUB, BLOCK_K, NORM,
                                  HAS_RESIDUAL)
    elif not NATIVE_FP8:
        y *= 256.0
    if PER_ROW:
        if NORM:
            row_scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
        y *= row_scale
    store_rows(out_ptr, y, rows, row_ok, tl.program_id(0), N, BLOCK_N, SWIGLU_OUT)


@triton.jit
def _fp8_float32_sums(w_rows, x_ptr, residual_ptr, norm_w_ptr, rstd, s_rows, row_ok, sub, cols, K: tl.constexpr,
                      GROUP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, PER_ROW: tl.constexpr,
                      NATIVE_FP8: tl.constexpr, BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr, SUB: tl.constexpr,
                      BLOCK_K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The rows' sums (before a per-row scale) in float32, a tile's products reduced as they come, so this rarely
    taken path adds few registers to the kernel."""
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        w = _fp8_weight_tile(w_rows, k, cols, row_ok, K, BLOCK_K)
        products = _fp8_tile_products(tl.zeros((BLOCK_N, TILE_GROUPS, SUB), dtype=tl.float32), w, k, x_ptr,
                                      residual_ptr, norm_w_ptr, rstd, s_rows, row_ok, sub, cols, K, GROUP_K,
                                      NUM_GROUPS, PER_ROW, NATIVE_FP8, SUB, BLOCK_K, NORM, HAS_RESIDUAL)
        y += tl.sum(tl.sum(products, axis=2), axis=1)
    if not NATIVE_FP8:
        y *= 256.0
    return y


@triton.jit
def _fp8_weight_tile(w_rows, k, cols, row_ok, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight bytes of the tile at column k: [BLOCK_N, TILE_GROUPS, SUB], 0 outside the matrix."""
    if K % BLOCK_K == 0:
        w = tl.load(w_rows + k + cols[None], mask=row_ok[:, None, None], other=0, eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + k + cols[None], mask=row_ok[:, None, None] & (k + cols < K)[None], other=0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _fp8_tile_products(acc, w, k, x_ptr, residual_ptr, norm_w_ptr, rstd, s_rows, row_ok, sub, cols,
                       K: tl.constexpr, GROUP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, PER_ROW: tl.constexpr,
                       NATIVE_FP8: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, F16_SUMS: tl.constexpr = False, F16_ASM: tl.constexpr = False,
                       SHARED_SCALES: tl.constexpr = False, s_shared=None, s_inv=1.0):
    """acc plus the tile's products w * x (times its groups' scales unless PER_ROW); with F16_SUMS (PER_ROW, or
    SHARED_SCALES: x times the groups' scales of s_shared over the largest, s_inv its inverse) acc is float16 and
    gains w * x / 256: in pairs by _f16_products (F16_ASM), in float16 arithmetic otherwise (the interpreter;
    without native FP8 the decoded weights are already / 256)."""
    col_ok = k + cols < K
    if NORM:
        x = normed_values(x_ptr, residual_ptr, norm_w_ptr, k + cols, col_ok, rstd, HAS_RESIDUAL)
    elif K % BLOCK_K == 0:
        x = tl.load(x_ptr + k + cols)
    else:
        x = tl.load(x_ptr + k + cols, mask=col_ok, other=0.0)
    if SHARED_SCALES:
        group = (k + sub * SUB) // GROUP_K
        group_scale = tl.load(s_shared + group, mask=group < NUM_GROUPS, other=0.0) * s_inv
        x = x.to(tl.float32) * group_scale[:, None]
    if F16_ASM:
        acc = _f16_products(acc, w, (x.to(tl.float32) * F16_X_SCALE).to(tl.float16)[None])
    elif F16_SUMS and NATIVE_FP8:
        acc += w.to(tl.float8e4nv, bitcast=True).to(tl.float16) * (x.to(tl.float32) * F16_X_SCALE).to(tl.float16)[None]
    elif F16_SUMS:
        acc += _e4m3_bits_to_float(w).to(tl.float16) * x.to(tl.float16)[None]
    else:
        if NATIVE_FP8:
            prod = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x.to(tl.float32)[None]
        else:
            prod = _e4m3_bits_to_float(w) * x.to(tl.float32)[None]
        if PER_ROW:
            acc += prod
        else:
            group = (k + sub * SUB) // GROUP_K
            s = tl.load(s_rows + group[None, :], mask=row_ok[:, None] & (group < NUM_GROUPS)[None, :], other=0.0)
            acc += prod * s[:, :, None]
    return acc


@triton.jit
def _int4_gemv_kernel(x_ptr, q_ptr, sz_ptr, rs_ptr, out_ptr, N, stride_qn, residual_ptr, norm_w_ptr, sum_ptr, eps,
                      K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr,
                      SUB: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                      FP4: tl.constexpr = False):
    """out[n] = sum_k (q[n, k] - z[n, g]) * s[n, g] * x[k], g = k // GROUP, q packed two columns a byte, s and z
    in one word sz[n, g] (scale_and_zero); with FP4, q is the e2m1 value of each code and sz the group's e4m3 byte,
    times the row's scale rs[n] (nibble_values, four_bit_scale_and_zero).
    The nibbles of a byte are interleaved back into column order in registers (join + reshape), so x is read
    contiguously. Per sub-tile (inside one group) it forms sum q*x and sum x, then adds s * (qx - z * xsum):
    the scale and zero cost one multiply-add per row and sub-tile, not per weight. GROUP == K is one group:
    the sums run over the whole row and the scale and zero are applied once at the end. NORM, PDL: as in
    _fp8_gemv_kernel."""
    HALF: tl.constexpr = SUB // 2
    BLOCK_K: tl.constexpr = TILE_GROUPS * SUB
    ONE_GROUP: tl.constexpr = GROUP == K
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    enter(PDL)
    if NORM:
        rstd = rms_of_sum(x_ptr, residual_ptr, sum_ptr, eps, tl.program_id(0) == 0, K, BLOCK_K, HAS_RESIDUAL)
    row_ok = rows < N
    sub = tl.arange(0, TILE_GROUPS)
    byte = sub[:, None] * HALF + tl.arange(0, HALF)[None, :]  # bytes of a tile, holding its columns 2b, 2b + 1
    cols = sub[:, None] * SUB + tl.arange(0, SUB)[None, :]
    q_rows = q_ptr + rows.to(tl.int64)[:, None, None] * stride_qn
    sz_rows = sz_ptr + rows.to(tl.int64)[:, None] * (K // GROUP)
    row_scale = four_bit_row_scales(rs_ptr, rows, row_ok, FP4)
    if ONE_GROUP:
        acc = tl.zeros((BLOCK_N, TILE_GROUPS, SUB), dtype=tl.float32)
        x_acc = tl.zeros((TILE_GROUPS, SUB), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, TILE_GROUPS), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            b = tl.load(q_rows + k // 2 + byte[None], mask=row_ok[:, None, None], other=0,
                        eviction_policy="evict_first")
            if NORM:
                x = normed_values(x_ptr, residual_ptr, norm_w_ptr, k + cols, k + cols < K, rstd,
                                  HAS_RESIDUAL).to(tl.float32)
            else:
                x = tl.load(x_ptr + k + cols).to(tl.float32)
        else:
            b = tl.load(q_rows + k // 2 + byte[None], mask=row_ok[:, None, None] & (k // 2 + byte < K // 2)[None],
                        other=0, eviction_policy="evict_first")
            if NORM:
                x = normed_values(x_ptr, residual_ptr, norm_w_ptr, k + cols, k + cols < K, rstd,
                                  HAS_RESIDUAL).to(tl.float32)
            else:
                x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        b = b.to(tl.int32)
        q = tl.join(nibble_values(b & 15, FP4), nibble_values(b >> 4, FP4)).reshape(BLOCK_N, TILE_GROUPS, SUB)
        if ONE_GROUP:
            acc += q * x[None]
            x_acc += x
        else:
            group = (k + sub * SUB) // GROUP
            group_ok = row_ok[:, None] & (group < K // GROUP)[None, :]
            s, z = four_bit_scale_and_zero(tl.load(sz_rows + group[None, :], mask=group_ok, other=0), FP4,
                                           _rows_column(row_scale, FP4))
            acc += s * (tl.sum(q * x[None], axis=2) - z * tl.sum(x, axis=1)[None, :])
    if ONE_GROUP:
        s, z = four_bit_scale_and_zero(tl.load(sz_ptr + rows, mask=row_ok, other=0), FP4, row_scale)
        y = s * (tl.sum(tl.sum(acc, axis=2), axis=1) - z * tl.sum(tl.sum(x_acc, axis=1), axis=0))
    else:
        y = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _rows_column(row_scale, FP4: tl.constexpr):
    """fp4's row scales [rows] as a column [rows, 1]; int4's 1.0 as it is."""
    if FP4:
        column = row_scale[:, None]
    else:
        column = row_scale
    return column


# The split-K 4-bit GEMV's products carry a factor 2**-SPLIT_SCALE_BITS (see _int4_split_gemv_kernel): x is scaled
# by at most 2**53 (finite up to |x| < 2**75) and a product n * x stays a normal float down to |n * x| = 2**-30.
SPLIT_SCALE_BITS = 96


@triton.jit
def _denormal(w, BIT: tl.constexpr):
    """The nibble of w at bits BIT..BIT+3, alone in a word read as a float32: the denormal n * 2**(BIT - 149),
    exactly, for one AND and no conversion instruction."""
    return (w & (15 << BIT)).to(tl.float32, bitcast=True)


@triton.jit
def _split_inputs(x_ptr, residual_ptr, norm_w_ptr, cols, rstd, SCALE_BITS: tl.constexpr, NORM: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr):
    """The sum of x over each sub-tile, and x at column 8 * word + j for each nibble position j (x0 ... x7, each
    shaped as `cols`, the first column of each word), scaled for nibble j's bit."""
    x_sum, _, x04, x15, x26, x37 = _input_pairs(x_ptr, residual_ptr, norm_w_ptr, cols, rstd, NORM, HAS_RESIDUAL)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return (x_sum, _scaled(x0, 0, SCALE_BITS), _scaled(x1, 4, SCALE_BITS), _scaled(x2, 8, SCALE_BITS),
            _scaled(x3, 12, SCALE_BITS), _scaled(x4, 16, SCALE_BITS), _scaled(x5, 8, SCALE_BITS),
            _scaled(x6, 12, SCALE_BITS), _scaled(x7, 16, SCALE_BITS))


@triton.jit
def _input_pairs(x_ptr, residual_ptr, norm_w_ptr, cols, rstd, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 LIMIT: tl.constexpr = 0):
    """The sub-tiles' inputs (RMSNorm(x + residual) with NORM) in float32: their sum over each sub-tile, the largest
    |x|, and the columns 8 * word + j and 8 * word + j + 4 of each word side by side ([sub-tile, word, 2] each, for
    j = 0 ... 3). One contiguous load of the sub-tiles' columns, then split by position in registers. LIMIT (when
    not 0): columns from LIMIT on read as 0."""
    offsets = cols[:, :, None] + tl.arange(0, 8)[None, None, :]
    if NORM and LIMIT:
        x = normed_values(x_ptr, residual_ptr, norm_w_ptr, offsets, offsets < LIMIT, rstd, HAS_RESIDUAL)
    elif NORM:
        x = normed_values(x_ptr, residual_ptr, norm_w_ptr, offsets, None, rstd, HAS_RESIDUAL)
    elif LIMIT:
        x = tl.load(x_ptr + offsets, mask=offsets < LIMIT, other=0.0)
    else:
        x = tl.load(x_ptr + offsets)
    x = x.to(tl.float32)
    # column 8 * word + j at [sub-tile, word, j // 4, (j // 2) % 2, j % 2]: pairs (j, j + 4) split off the others
    even, odd = tl.split(x.reshape(cols.shape[0], cols.shape[1], 2, 2, 2))
    x04, x26 = tl.split(even)
    x15, x37 = tl.split(odd)
    return tl.sum(tl.sum(x, axis=2), axis=1), tl.max(tl.abs(x)), x04, x15, x26, x37


@triton.jit
def _scaled(x, BIT: tl.constexpr, SCALE_BITS: tl.constexpr):
    """x times 2**(149 - SCALE_BITS - BIT), as a [sub-tile, 1, word] operand of the weights' [sub-tile, row, word]
    tile: a nibble at bit BIT read as a denormal, times this, is n * x * 2**-SCALE_BITS."""
    return (x * (2.0 ** (149 - SCALE_BITS - BIT)))[:, None, :]


@triton.jit
def _int4_split_gemv_kernel(x_ptr, q_ptr, sz_ptr, rs_ptr, part_ptr, arrivals_ptr, out_ptr, N, stride_qw,
                            residual_ptr, norm_w_ptr, sum_ptr, eps, K: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                            ROW_TILES: tl.constexpr, SCALE_BITS: tl.constexpr, NORM: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, SWIGLU_OUT: tl.constexpr = False,
                            PRELOAD: tl.constexpr = 0, F16_SUMS: tl.constexpr = False, F16_ASM: tl.constexpr = False,
                            FP4: tl.constexpr = False):
    """Program (k split, row block): part[split, n] = sum over the split's SPLIT_K columns of (q - z) * s * x for
    ROW_TILES tiles of BLOCK_N rows, then the row block's last program to finish sums the splits into out; with
    one split (SPLIT_K == K) each program stores its rows' products itself. SWIGLU_OUT: N counts the features of a
    [gate | up] weight and a tile's rows are BLOCK_N / 2 features' gate and up rows side by side
    (gemv.program_rows); the program that stores a tile stores silu(gate) * up (gemv.store_rows).

    The tiled kernel above reloads and converts x for every tile, in a layout the weights' does not match, and
    turns every nibble into a float by a conversion instruction (a quarter of the FMA rate). Here the weights are
    read as 32-bit words of eight columns: a nibble masked in place is a float32 denormal n * 2**(bit - 149), so
    one AND and one FMA take a weight into the sum (x pre-scaled by 2**(149 - SCALE_BITS - bit) per nibble
    position; the products are exact to float32 rounding, 2**-SCALE_BITS times n * x, and the sum is scaled back
    once per sub-tile). A sub-tile of SUB columns lies inside one group: s * (sum n * x - z * sum x) per row and
    sub-tile. A tile is [sub-tile, row, word], so a warp's lanes lie along K (each holds x for a few words only)
    and its rows are repeated in each thread: x's registers do not grow with the rows (on an H100 13-14% faster
    on gate/up and down than rows across lanes).

    A split walks its columns CHUNK at a time; with PRELOAD its first chunk of words is loaded before the
    dependent-launch wait (weights: no kernel of the chain writes them), so those loads overlap the end of the
    kernel before. CHUNK == SPLIT_K: the program's x slice is loaded once and held in registers, pre-scaled, and the
    next row tile's words are loaded before the current one is reduced. Wider splits load x's chunk again for each
    chunk of words, from L1 or L2, so that x's registers stay those of one chunk (on an H100 faster alone for
    Llama-3-8B's gate/up and down, slower inside a decode step: not among the start-up candidates).

    Partial sums go to part (float32); each program then counts itself in arrivals[row block]
    (kernels/triton/arrivals.py), and the last one sums the K // SPLIT_K partial sums of the block's rows in split
    order, so results repeat bit for bit. NORM, PDL: as in _fp8_gemv_kernel (every program computes the norm's
    1 / rms; program (0, 0) stores the sum).

    F16_SUMS (CHUNK == SPLIT_K, SUB >= 16): two words' products summed in a pair of float16 sums (_word_pair_sums),
    x scaled by a power of two per program so its largest magnitude lands in [2**14, 2**15) (_split_pairs); with
    F16_ASM (a GPU) by paired instructions, 21 for 16 weights where the float32 products take 34.

    FP4 (F16_SUMS only): the nibbles are e2m1 codes (quant_pack's "fp4" layout: each group's scale an e4m3 byte
    times the row's scale rs[n], no zero point), each moved into a float16 half as e2m1 * 2**-14 by two shifts and
    two masks (_word_pair_sums), 37 instructions for 16 weights where the tiled kernel's float32 decode takes about
    140.

    A split of SPLIT_K columns that is not a power of two (F16_SUMS only: K = 2688 = 3 x 896, or 3712 whole) is held
    in CHUNK, the next power of two: the sub-tiles past the split load no words and take no scale, and x is read up
    to K only (a neighbour split's columns may set the power of two x is scaled by, nothing else).

    Invariant: float32 denormals are kept, not flushed to zero (Triton's default); a flush would zero every
    product, which the start-up check against float64 would catch before the kernel serves."""
    tl.static_assert(not F16_SUMS or (CHUNK >= SPLIT_K and SUB >= 16), "float16 sums: x held, pairs of words")
    tl.static_assert(F16_SUMS or not FP4, "e2m1 codes: float16 sums only")
    tl.static_assert(F16_SUMS or CHUNK <= SPLIT_K, "a split padded to a power of two: float16 sums only")
    PADDED: tl.constexpr = CHUNK > SPLIT_K
    SPLIT_SUBS: tl.constexpr = SPLIT_K // SUB if PADDED else 0  # the split's sub-tiles; 0: all of CHUNK's
    SUBS: tl.constexpr = CHUNK // SUB
    WORDS: tl.constexpr = SUB // 8
    SPLITS: tl.constexpr = K // SPLIT_K
    ROWS: tl.constexpr = 2 if SWIGLU_OUT else 1  # weight rows per output: a split's partial sums are ROWS * N
    split = tl.program_id(0)
    k0 = split * SPLIT_K
    if SPLITS == 1:
        k0 = 0  # known to the compiler: on sm_90 96 registers a thread instead of 128 (whole rows, 16 a program)
    sub = tl.arange(0, SUBS)
    word = sub[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    first_tile = tl.program_id(1) * ROW_TILES
    rows, row_ok = program_rows(first_tile, N, BLOCK_N, SWIGLU_OUT)
    if PRELOAD:  # weights: no kernel of the chain writes them (pdl.py)
        w_first = _chunk_words(q_ptr, rows, row_ok, stride_qw, k0, word, SPLIT_SUBS * WORDS)
    enter(PDL)
    if not PRELOAD:
        w_first = _chunk_words(q_ptr, rows, row_ok, stride_qw, k0, word, SPLIT_SUBS * WORDS)
    rstd = 0.0
    if NORM:
        rstd = rms_of_sum(x_ptr, residual_ptr, sum_ptr, eps, (split == 0) & (tl.program_id(1) == 0), K, CHUNK,
                          HAS_RESIDUAL)
    if F16_SUMS:
        x_sum, x04, x15, x26, x37, unscale = _split_pairs(x_ptr, residual_ptr, norm_w_ptr, k0 + word * 8, rstd, NORM,
                                                          HAS_RESIDUAL, FP4, K if PADDED else 0)
    elif CHUNK == SPLIT_K:
        x_sum, x0, x1, x2, x3, x4, x5, x6, x7 = _split_inputs(x_ptr, residual_ptr, norm_w_ptr, k0 + word * 8, rstd,
                                                             SCALE_BITS, NORM, HAS_RESIDUAL)
    if CHUNK >= SPLIT_K:
        w_next = w_first
        for t in range(ROW_TILES):
            w = w_next  # the next row tile's words are loaded before this one is reduced
            rows, row_ok = program_rows(first_tile + t, N, BLOCK_N, SWIGLU_OUT)
            next_rows, next_ok = program_rows(first_tile + t + 1, N, BLOCK_N, SWIGLU_OUT)
            w_next = _chunk_words(q_ptr, next_rows, next_ok & (t + 1 < ROW_TILES), stride_qw, k0, word,
                                  SPLIT_SUBS * WORDS)
            if F16_SUMS:
                sums = _pair_tile_sums(w, x_sum, x04, x15, x26, x37, unscale, sz_ptr, rows, row_ok, k0, sub, K, GROUP,
                                       SUB, F16_ASM, FP4, SPLIT_SUBS)
            else:
                sums = _word_tile_sums(w, x_sum, x0, x1, x2, x3, x4, x5, x6, x7, sz_ptr, rows, row_ok, k0, sub, K,
                                       GROUP, SUB, SCALE_BITS)
            y = tl.sum(sums, axis=0) * fp4_row_factor(rs_ptr, rows, row_ok, FP4)
            _split_result(y, part_ptr + split * (ROWS * N), out_ptr, rows, row_ok, first_tile + t, N, BLOCK_N,
                          SPLITS, SWIGLU_OUT)
    else:
        acc = _chunk_sums(w_first, x_ptr, residual_ptr, norm_w_ptr, rstd, sz_ptr, rows, row_ok, k0, sub, word, K,
                          GROUP, SUB, SCALE_BITS, NORM, HAS_RESIDUAL)
        for t in range(ROW_TILES):
            rows, row_ok = program_rows(first_tile + t, N, BLOCK_N, SWIGLU_OUT)
            for c in range(CHUNK * (t == 0), SPLIT_K, CHUNK):  # the first tile's first chunk is summed above
                w = _chunk_words(q_ptr, rows, row_ok, stride_qw, k0 + c, word)
                acc += _chunk_sums(w, x_ptr, residual_ptr, norm_w_ptr, rstd, sz_ptr, rows, row_ok, k0 + c, sub, word,
                                   K, GROUP, SUB, SCALE_BITS, NORM, HAS_RESIDUAL)
            _split_result(tl.sum(acc, axis=0), part_ptr + split * (ROWS * N), out_ptr, rows, row_ok, first_tile + t,
                          N, BLOCK_N, SPLITS, SWIGLU_OUT)
            acc = tl.zeros((SUBS, BLOCK_N), dtype=tl.float32)
    if SPLITS > 1:
        if last_to_arrive(arrivals_ptr, tl.program_id(1), SPLITS):
            for t in range(ROW_TILES):
                rows, row_ok = program_rows(first_tile + t, N, BLOCK_N, SWIGLU_OUT)
                y = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for p in range(SPLITS):
                    y += tl.load(part_ptr + p * (ROWS * N) + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
                store_rows(out_ptr, y, rows, row_ok, first_tile + t, N, BLOCK_N, SWIGLU_OUT)
            leave(arrivals_ptr, tl.program_id(1))


@triton.jit
def _chunk_words(q_ptr, rows, row_ok, stride_qw, k, word, WORD_LIMIT: tl.constexpr = 0):
    """The [sub-tile, row, word] tile of 32-bit words of `rows` from column k on; 0 where not row_ok, and from word
    WORD_LIMIT on where that is not 0."""
    mask = row_ok[None, :, None]
    if WORD_LIMIT:
        mask = mask & (word < WORD_LIMIT)[:, None, :]
    return tl.load(q_ptr + rows.to(tl.int64)[None, :, None] * stride_qw + k // 8 + word[:, None, :],
                   mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def _chunk_sums(w, x_ptr, residual_ptr, norm_w_ptr, rstd, sz_ptr, rows, row_ok, k, sub, word, K: tl.constexpr,
                GROUP: tl.constexpr, SUB: tl.constexpr, SCALE_BITS: tl.constexpr, NORM: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr):
    """_word_tile_sums of the words w of a chunk at column k, x's chunk loaded for it."""
    x_sum, x0, x1, x2, x3, x4, x5, x6, x7 = _split_inputs(x_ptr, residual_ptr, norm_w_ptr, k + word * 8, rstd,
                                                         SCALE_BITS, NORM, HAS_RESIDUAL)
    return _word_tile_sums(w, x_sum, x0, x1, x2, x3, x4, x5, x6, x7, sz_ptr, rows, row_ok, k, sub, K, GROUP, SUB,
                           SCALE_BITS)


@triton.jit
def _word_tile_sums(w, x_sum, x0, x1, x2, x3, x4, x5, x6, x7, sz_ptr, rows, row_ok, k, sub, K: tl.constexpr,
                    GROUP: tl.constexpr, SUB: tl.constexpr, SCALE_BITS: tl.constexpr):
    """[sub-tile, row]: s * (sum n * x - z * sum x) over each sub-tile of the [sub-tile, row, word] tile of words w
    at column k, x as _split_inputs gives it."""
    h = w >> 12  # nibbles 5-7 at bits 8, 12, 16: below the exponent bits, as nibbles 0-4 are in w
    products = (_denormal(w, 0) * x0 + _denormal(w, 4) * x1 + _denormal(w, 8) * x2 + _denormal(w, 12) * x3
                + _denormal(w, 16) * x4 + _denormal(h, 8) * x5 + _denormal(h, 12) * x6
                + _denormal(h, 16) * x7)  # [sub-tile, row, word]
    return _group_scaled(tl.sum(products, axis=2) * (2.0 ** SCALE_BITS), x_sum, sz_ptr, rows, row_ok, k, sub, K,
                         GROUP, SUB)


@triton.jit
def _group_scaled(qx, x_sum, sz_ptr, rows, row_ok, k, sub, K: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr,
                  FP4: tl.constexpr = False, SUB_LIMIT: tl.constexpr = 0):
    """[sub-tile, row]: s * (qx - z * x_sum), qx the sums of n * x over each sub-tile of the rows, with the scale s
    and zero point z of the group each sub-tile lies in (scale_and_zero); FP4: e4m3_scale_units(s) * qx, the row's
    scale times FP4_SCALE_UNIT left to the caller, once a row after the sub-tiles' sum (fp4_row_factor); 0 for
    sub-tiles past K, and from sub-tile SUB_LIMIT on where that is not 0."""
    return apply_group_scales(qx, x_sum, group_scale_words(sz_ptr, rows, row_ok, k, sub, K, GROUP, SUB, SUB_LIMIT),
                              FP4)


@triton.jit
def group_scale_words(sz_ptr, rows, row_ok, k, sub, K: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr,
                      SUB_LIMIT: tl.constexpr = 0):
    """[sub-tile, row]: the scale word (int4) or e4m3 byte (fp4) of the group each sub-tile of SUB columns from
    column k lies in; 0 for sub-tiles past K, and from sub-tile SUB_LIMIT on where that is not 0."""
    group = (k + sub * SUB) // GROUP
    inside = group < K // GROUP
    if SUB_LIMIT:
        inside = inside & (sub < SUB_LIMIT)
    return tl.load(sz_ptr + rows.to(tl.int64)[None, :] * (K // GROUP) + group[:, None],
                   mask=row_ok[None, :] & inside[:, None], other=0)


@triton.jit
def apply_group_scales(qx, x_sum, words, FP4: tl.constexpr):
    """_group_scaled's product of the sub-tiles' sums qx by their groups' scale words (group_scale_words)."""
    if FP4:
        scaled = e4m3_scale_units(words) * qx
    else:
        s, z = scale_and_zero(words)
        scaled = s * (qx - z * x_sum[:, None])
    return scaled


@triton.jit
def _split_pairs(x_ptr, residual_ptr, norm_w_ptr, cols, rstd, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 FP4: tl.constexpr = False, LIMIT: tl.constexpr = 0):
    """For float16 sums: the sum of x over each sub-tile; x at columns 8 * word + j and 8 * word + j + 4 as float16
    pairs in one 32-bit word (x04, x15, x26, x37: [sub-tile, 1, word]), times 2**e, the power of two that puts the
    program's largest |x| in [2**14, 2**15), and (int4) times 2**-4 more for odd j (_word_pair_sums reads their
    nibbles 16 times too large); and what takes the float16 sums back to x's scale: 2**(24 - e) for int4's nibbles
    read as n * 2**-24, 2**(14 - e) for e2m1 codes read as their value * 2**-14 (FP4). LIMIT: as _input_pairs'."""
    x_sum, x_max, x04, x15, x26, x37 = _input_pairs(x_ptr, residual_ptr, norm_w_ptr, cols, rstd, NORM,
                                                    HAS_RESIDUAL, LIMIT)
    # the largest |x|'s biased exponent, kept where both scales are normal floats (x = 0 takes the smallest)
    exponent = tl.minimum(tl.maximum((x_max.to(tl.int32, bitcast=True) >> 23) & 0xFF, 14), 244)
    scale = ((268 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(141 - exponent)
    if FP4:
        unscale = (exponent << 23).to(tl.float32, bitcast=True)  # 2**(exponent - 127) = 2**14 / scale
        return (x_sum, _f16_pair(x04, scale), _f16_pair(x15, scale), _f16_pair(x26, scale), _f16_pair(x37, scale),
                unscale)
    unscale = ((exponent + 10) << 23).to(tl.float32, bitcast=True)  # 2**(exponent - 117) = 2**24 / scale
    return (x_sum, _f16_pair(x04, scale), _f16_pair(x15, scale * 0.0625), _f16_pair(x26, scale),
            _f16_pair(x37, scale * 0.0625), unscale)


@triton.jit
def _f16_pair(x, scale):
    """[sub-tile, word, 2] float32 -> [sub-tile, 1, word] int32: x[..., 0] * scale as float16 in the low half,
    x[..., 1] * scale in the high half."""
    lo, hi = tl.split((x * scale).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
    return (lo | (hi << 16))[:, None, :]


def _e2m1_pairs_asm(word: str) -> str:
    """PTX that moves the eight e2m1 codes of 32-bit `word` into four float16 pairs a, b, c, d (codes j and j + 4 in
    pair j): the three magnitude bits of code j (bits 4j .. 4j + 2) shifted to bits 9-11, its sign bit (4j + 3) to
    15, with one shift each for both halves; uses the scratch registers m and s."""
    lines = []
    for pair, bit in zip("abcd", (0, 4, 8, 12)):
        for reg, target in (("m", 9), ("s", 12)):
            shift = target - bit
            if shift > 0:
                lines.append(f"shl.b32 {reg}, {word}, {shift};")
            elif shift < 0:
                lines.append(f"shr.u32 {reg}, {word}, {-shift};")
            else:
                lines.append(f"mov.b32 {reg}, {word};")
        lines += ["and.b32 m, m, 0x0E000E00;", "and.b32 s, s, 0x80008000;", f"or.b32 {pair}, m, s;"]
    return "\n".join(lines)


# _word_pair_sums' products for e2m1 codes: words $1 and $2, x pairs $3-$6 and $7-$10, the float32 sum in $0.
_FP4_PAIR_SUMS_ASM = tl.constexpr("\n".join([
    "{", ".reg .b32 a, b, c, d, m, s, t;", ".reg .b16 lo, hi;", ".reg .f32 fl, fh;",
    _e2m1_pairs_asm("$1"),
    "mul.rn.f16x2 t, a, $3;", "fma.rn.f16x2 t, b, $4, t;", "fma.rn.f16x2 t, c, $5, t;", "fma.rn.f16x2 t, d, $6, t;",
    _e2m1_pairs_asm("$2"),
    "fma.rn.f16x2 t, a, $7, t;", "fma.rn.f16x2 t, b, $8, t;", "fma.rn.f16x2 t, c, $9, t;", "fma.rn.f16x2 t, d, $10, t;",
    "mov.b32 {lo, hi}, t;", "cvt.f32.f16 fl, lo;", "cvt.f32.f16 fh, hi;", "add.f32 $0, fl, fh;", "}"]))


@triton.jit
def _word_pair_sums(w, x04, x15, x26, x37, SUBS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr,
                    ASM: tl.constexpr, FP4: tl.constexpr = False):
    """[sub-tile, row, word pair]: the sum of n * x * 2**-24 over the sixteen nibbles n of two adjacent words of the
    [sub-tile, row, word] tile w, x as _split_pairs packs it; the nibbles j < 4 of both words summed in one float16,
    those j >= 4 in the other, then added in float32. A nibble masked in place in a float16 half is the denormal
    n * 2**-24 (16 n * 2**-24 at odd j), so one AND makes two weights a float16 pair and one paired multiply-add
    takes both into the sums: with ASM (a GPU) 21 instructions for 16 weights, against 34 for the float32 products.
    The interpreter computes the same roundings in float32 (_half_sum).

    FP4: the nibbles are e2m1 codes. Code j's three magnitude bits shifted to bits 9-11 of a float16 half (j + 4's
    to 25-27: one shift for both) are the float16 of its value times 2**-14 (exponent bits 10-11, the mantissa's top
    bit 9; codes 0 and 1 its subnormals 0 and 2**-15), and its sign bit shifted to bit 15 (31) signs it: two shifts
    and two masks a pair, then the same paired multiply-adds."""
    wa, wb = _adjacent(w, SUBS, ROWS, WORDS)
    a04, b04 = _adjacent(x04, SUBS, ROWS, WORDS)
    a15, b15 = _adjacent(x15, SUBS, ROWS, WORDS)
    a26, b26 = _adjacent(x26, SUBS, ROWS, WORDS)
    a37, b37 = _adjacent(x37, SUBS, ROWS, WORDS)
    if ASM and FP4:
        return tl.inline_asm_elementwise(
            _FP4_PAIR_SUMS_ASM,
            "=r,r,r,r,r,r,r,r,r,r,r", [wa, wb, a04, a15, a26, a37, b04, b15, b26, b37],
            dtype=tl.float32, is_pure=True, pack=1)
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a, b, c, d, h, t;
            .reg .b16 lo, hi;
            .reg .f32 fl, fh;
            and.b32 a, $1, 0x000F000F;
            and.b32 b, $1, 0x00F000F0;
            shr.u32 h, $1, 8;
            and.b32 c, h, 0x000F000F;
            and.b32 d, h, 0x00F000F0;
            mul.rn.f16x2 t, a, $3;
            fma.rn.f16x2 t, b, $4, t;
            fma.rn.f16x2 t, c, $5, t;
            fma.rn.f16x2 t, d, $6, t;
            and.b32 a, $2, 0x000F000F;
            and.b32 b, $2, 0x00F000F0;
            shr.u32 h, $2, 8;
            and.b32 c, h, 0x000F000F;
            and.b32 d, h, 0x00F000F0;
            fma.rn.f16x2 t, a, $7, t;
            fma.rn.f16x2 t, b, $8, t;
            fma.rn.f16x2 t, c, $9, t;
            fma.rn.f16x2 t, d, $10, t;
            mov.b32 {lo, hi}, t;
            cvt.f32.f16 fl, lo;
            cvt.f32.f16 fh, hi;
            add.f32 $0, fl, fh;
            }""",
            "=r,r,r,r,r,r,r,r,r,r,r", [wa, wb, a04, a15, a26, a37, b04, b15, b26, b37],
            dtype=tl.float32, is_pure=True, pack=1)
    lo = _half_sum(wb, b04, b15, b26, b37, 0, _half_sum(wa, a04, a15, a26, a37, 0, 0.0, FP4), FP4)
    hi = _half_sum(wb, b04, b15, b26, b37, 16, _half_sum(wa, a04, a15, a26, a37, 16, 0.0, FP4), FP4)
    return lo + hi


@triton.jit
def _adjacent(t, SUBS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """A [sub-tile, row or 1, word] tensor, broadcast over the rows, as its even and its odd words."""
    return tl.split(tl.broadcast_to(t, (SUBS, ROWS, WORDS)).reshape(SUBS, ROWS, WORDS // 2, 2))


@triton.jit
def _half_sum(w, x04, x15, x26, x37, HALF: tl.constexpr, t, FP4: tl.constexpr):
    """t plus the products of one word in _word_pair_sums' low (HALF 0) or high (HALF 16) float16 sum, rounded
    after each as the paired multiply-adds round."""
    t = (t + _nibble_product(w, x04, HALF, HALF, FP4)).to(tl.float16).to(tl.float32)
    t = (t + _nibble_product(w, x15, HALF + 4, HALF, FP4)).to(tl.float16).to(tl.float32)
    t = (t + _nibble_product(w, x26, HALF + 8, HALF, FP4)).to(tl.float16).to(tl.float32)
    return (t + _nibble_product(w, x37, HALF + 12, HALF, FP4)).to(tl.float16).to(tl.float32)


@triton.jit
def _nibble_product(w, pair, BIT: tl.constexpr, HALF: tl.constexpr, FP4: tl.constexpr):
    """The nibble at bit BIT times the pair's float16 half at bit HALF, as the paired instructions see them (the
    nibble as 2**-24 n, or 2**-20 n at odd positions; an e2m1 code as its value * 2**-14), exact in float32."""
    if FP4:
        n = nibble_values((w >> BIT) & 15, True) * (2.0 ** -14)
    else:
        n = ((w >> BIT) & 15).to(tl.float32) * (2.0 ** -24 if (BIT - HALF) % 8 == 0 else 2.0 ** -20)
    return n * ((pair >> HALF) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair_tile_sums(w, x_sum, x04, x15, x26, x37, unscale, sz_ptr, rows, row_ok, k, sub, K: tl.constexpr,
                    GROUP: tl.constexpr, SUB: tl.constexpr, ASM: tl.constexpr, FP4: tl.constexpr = False,
                    SUB_LIMIT: tl.constexpr = 0):
    """_word_tile_sums with float16 sums (_word_pair_sums); FP4 and SUB_LIMIT as _group_scaled's (FP4's row factor
    left to the caller)."""
    sums = _word_pair_sums(w, x04, x15, x26, x37, w.shape[0], w.shape[1], SUB // 8, ASM, FP4)
    return _group_scaled(tl.sum(sums, axis=2) * unscale, x_sum, sz_ptr, rows, row_ok, k, sub, K, GROUP, SUB, FP4,
                         SUB_LIMIT)


@triton.jit
def fp4_row_factor(rs_ptr, rows, row_ok, FP4: tl.constexpr):
    """What an FP4 row's sum of _group_scaled terms is multiplied by: its row scale times FP4_SCALE_UNIT (0 where
    not row_ok); 1.0 for int4, whose terms are whole."""
    if FP4:
        factor = four_bit_row_scales(rs_ptr, rows, row_ok, FP4) * FP4_SCALE_UNIT
    else:
        factor = 1.0
    return factor


@triton.jit
def _split_result(y, split_part_ptr, out_ptr, rows, row_ok, tile, N, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                  SWIGLU_OUT: tl.constexpr):
    """A row tile's sums over one split: the output itself where there is one split, else a partial sum in the
    split's row of part (split_part_ptr)."""
    if SPLITS == 1:
        store_rows(out_ptr, y, rows, row_ok, tile, N, BLOCK_N, SWIGLU_OUT)
    else:
        tl.store(split_part_ptr + rows, y, mask=row_ok)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int, block_n: int = 8,
             block_k: int = 512, num_warps: int = 4, num_stages: int = 3, f16_sums: bool = False, *,
             swiglu_out: bool = False) -> torch.Tensor:
    """x [1, K] (or [K]) times the fp8 weight [N, K]^T with scale [N, ceil(K / group_k)] -> [1, N] in x's
    dtype. group_k >= K is one scale per row. block_n and block_k are powers of two; a block_k tile spans
    block_k / SUB sub-tiles of SUB = min(block_k, largest power of two dividing group_k) columns. `f16_sums`:
    partial sums in float16 pairs (the kernel's F16_SUMS): one scale a row, or groups whose scales each aligned run
    of block_n rows shares (rows_share_scales(scale) >= block_n: the caller's to know; a ValueError only where N
    does not divide into such runs or with swiglu_out). With
    `swiglu_out`, silu(gate) * up of a [gate | up] weight, [1, N / 2] (gemv.gemv's)."""
    x = _one_row(x, weight.shape[1], "fp8_gemv")
    return _fp8_launch(x, weight, scale, group_k, (block_n, block_k, num_warps, num_stages, f16_sums), None,
                       swiglu_out)


def fp8_gemv_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, scale: torch.Tensor, group_k: int, block_n: int = 8, block_k: int = 512,
                     num_warps: int = 4, num_stages: int = 3, f16_sums: bool = False, *,
                     swiglu_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_gemv of RMSNorm(x + residual), x + residual) in one launch, as gemv.gemv_rmsnorm for 16-bit weights
    (without a residual, the second is x itself); `f16_sums` and `swiglu_out` as in fp8_gemv."""
    return _normed_launch("fp8_gemv_rmsnorm", x, residual, norm_weight, eps, weight.shape[1], lambda x, norm: (
        _fp8_launch(x, weight, scale, group_k, (block_n, block_k, num_warps, num_stages, f16_sums), norm,
                    swiglu_out)))


def _fp8_launch(x, weight, scale, group_k: int, config, norm, swiglu_out: bool = False) -> torch.Tensor:
    """config: (block_n, block_k, num_warps, num_stages, f16_sums). norm: None, or (residual or None, norm weight,
    the sum's tensor, eps) for the norm-fused form."""
    check_fp8(weight, scale, group_k)
    block_n, block_k, num_warps, num_stages, f16_sums = config
    _check_blocks(block_n, block_k, 1)
    k = weight.shape[1]
    per_row = fp8_groups(k, group_k) == 1
    # float16 sums of groups: where every aligned run of block_n rows shares its scales (rows_share_scales).
    shared = bool(f16_sums) and not per_row
    if shared and (swiglu_out or weight.shape[0] % block_n):
        raise ValueError(f"float16 sums of groups of {group_k} columns take rows that share their scales in runs of "
                         f"block_n {block_n}, without SwiGLU out")
    sub = block_k if per_row else min(block_k, group_k & -group_k)
    native = _native_fp8(x.device)
    n, programs = output_rows(weight, block_n, swiglu_out)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    residual, norm_weight, summed, eps = norm or (None, x, x, 0.0)
    _fp8_gemv_kernel[(programs,)](
        x, weight.view(torch.uint8), scale, out, n, weight.stride(0), x if residual is None else residual,
        norm_weight, summed, eps, K=k, GROUP_K=k if per_row else group_k, PER_ROW=per_row, NATIVE_FP8=native,
        BLOCK_N=block_n, TILE_GROUPS=block_k // sub, SUB=sub, NORM=norm is not None,
        HAS_RESIDUAL=residual is not None, num_warps=num_warps, num_stages=num_stages,
        PRELOAD=min(preload_tiles(), 1), SWIGLU_OUT=swiglu_out, F16_SUMS=bool(f16_sums),
        F16_ASM=bool(f16_sums) and native and x.is_cuda, SHARED_SCALES=shared,
        GROUPS_P=triton.next_power_of_2(fp8_groups(k, group_k)), **pdl.launch(x.device))
    return out


def rows_share_scales(scale: torch.Tensor, most: int = 32) -> int:
    """The largest power of two R <= `most` dividing scale's rows such that each aligned run of R rows holds one
    scale row: a block-scaled FP8 checkpoint's 128-row blocks, expanded a row each (where a rank's rows start on a
    block's boundary); 1 where none does. fp8_gemv's float16 sums of groups need block_n <= R."""
    n = scale.shape[0]
    rows = most
    while rows > 1:
        if n % rows == 0:
            runs = scale.reshape(n // rows, rows, -1)
            if torch.equal(runs, runs[:, :1].expand_as(runs)):
                return rows
        rows //= 2
    return 1


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
              block_n: int = 8, block_k: int = 512, num_warps: int = 4, num_stages: int = 3,
              codes: str = "int4", row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) times the 4-bit weight (qweight [N, K // 2], scale_zero [N, K // group_size]:
    kernels/quant_pack.py's "int4" layout, or "fp4" with codes="fp4", e4m3 bytes and row_scale [N])
    transposed -> [1, N] in x's dtype. block_n and block_k (columns, not bytes) are powers of two, block_k >= 2;
    a tile spans block_k / SUB sub-tiles of SUB = min(block_k, largest power of two dividing group_size)
    columns, or one of block_k columns when group_size == K."""
    x = _one_row(x, 2 * qweight.shape[1], "int4_gemv")
    return _int4_launch(x, qweight, scale_zero, group_size, (block_n, block_k, num_warps, num_stages), None, codes,
                        row_scale)


def int4_gemv_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      qweight: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                      block_n: int = 8, block_k: int = 512, num_warps: int = 4,
                      num_stages: int = 3, codes: str = "int4", row_scale: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int4_gemv of RMSNorm(x + residual), x + residual) in one launch, as fp8_gemv_rmsnorm."""
    return _normed_launch("int4_gemv_rmsnorm", x, residual, norm_weight, eps, 2 * qweight.shape[1], lambda x, norm: (
        _int4_launch(x, qweight, scale_zero, group_size, (block_n, block_k, num_warps, num_stages), norm, codes,
                     row_scale)))


def _int4_launch(x, qweight, scale_zero, group_size: int, config, norm, codes: str = "int4",
                 row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """norm: as in _fp8_launch; codes: "int4" or "fp4" (the decode table); row_scale: fp4's."""
    check_int4(qweight, scale_zero, group_size, codes, row_scale)
    block_n, block_k, num_warps, num_stages = config
    _check_blocks(block_n, block_k, 2)
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    sub = block_k if group_size == k else min(block_k, group_size & -group_size)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    residual, norm_weight, summed, eps = norm or (None, x, x, 0.0)
    _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scale_zero, row_scale_pointer(row_scale, scale_zero), out, n, qweight.stride(0),
        x if residual is None else residual, norm_weight,
        summed, eps, K=k, GROUP=group_size, BLOCK_N=block_n, TILE_GROUPS=block_k // sub, SUB=sub,
        NORM=norm is not None, HAS_RESIDUAL=residual is not None, num_warps=num_warps, num_stages=num_stages,
        FP4=_fp4_codes(codes), **pdl.launch(x.device))
    return out


def row_scale_pointer(row_scale: torch.Tensor | None, scale_zero: torch.Tensor) -> torch.Tensor:
    """What a 4-bit kernel takes for its row scales: fp4's, or where there are none (int4, never read) the scale
    words."""
    return scale_zero if row_scale is None else row_scale


def _fp4_codes(codes: str) -> bool:
    """Whether 4-bit codes are e2m1 ("fp4") rather than integers ("int4")."""
    if codes not in FOUR_BIT_KINDS:
        raise ValueError(f"4-bit codes are one of {', '.join(FOUR_BIT_KINDS)}, got {codes!r}")
    return codes == "fp4"


# The split kernel walks a wider split in chunks of this many columns (x's registers are one chunk's).
INT4_SPLIT_CHUNK = 1024


# A split whose width is not a power of two is held padded to the next one, up to this many columns (float16 sums).
INT4_PADDED_CHUNK = 4096


def int4_split_sub(k: int, group_size: int, split_k: int) -> int | None:
    """The split kernel's sub-tile width for K columns in groups of group_size split every split_k columns, or
    None where it cannot take the shape (split_k of at least 8 dividing K, a power of two or, padded to one, at most
    INT4_PADDED_CHUNK columns in sub-tiles of 16 or more; sub-tiles of whole 32-bit words inside one group)."""
    sub = min(split_k & -split_k, INT4_SPLIT_CHUNK, group_size & -group_size)
    if split_k < 8 or k % split_k or sub % 8:
        return None
    if split_k & (split_k - 1) and (sub < 16 or triton.next_power_of_2(split_k) > INT4_PADDED_CHUNK):
        return None
    return sub


def int4_split_takes_f16_sums(split_k: int, sub: int) -> bool:
    """Whether the split kernel can sum in float16 pairs (F16_SUMS) with splits of split_k columns in sub-tiles of
    `sub` (int4_split_sub's): x held for the whole split, and whole pairs of words in each sub-tile."""
    return (split_k <= INT4_SPLIT_CHUNK or split_k & (split_k - 1) != 0) and sub >= 16


def int4_padded_splits(k: int, most_waste: float = 0.25) -> list[int]:
    """Widths that split K into 1 to 8 equal parts, none a power of two, each padded to the next power of two
    (at most INT4_PADDED_CHUNK columns) with at most `most_waste` of it past the split: K = 2688 gives 896, 448 and
    384, K = 3712 gives 3712, 1856, 928 and 464."""
    widths = [k // parts for parts in range(1, 9) if k % parts == 0 and (k // parts) % 16 == 0]
    return [w for w in widths if w & (w - 1) and triton.next_power_of_2(w) <= INT4_PADDED_CHUNK
            and 1 - w / triton.next_power_of_2(w) <= most_waste]


def int4_gemv_split(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor,
                    group_size: int, block_n: int = 64, split_k: int = 512, num_warps: int = 4,
                    row_tiles: int = 1, f16_sums: bool = False, *, swiglu_out: bool = False,
                    codes: str = "int4", row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """int4_gemv by the split-K kernel (_int4_split_gemv_kernel): programs of split_k columns by row_tiles tiles
    of block_n rows. Raises ValueError where the shape does not fit it (int4_split_sub), where the weight's rows
    are not whole 32-bit words, or where there are more row blocks than arrival counts. `f16_sums`: two words'
    products summed in a pair of float16 sums (the kernel's F16_SUMS; splits of at most INT4_SPLIT_CHUNK columns
    or, not a power of two, padded to one (int4_split_sub), sub-tiles of 16 columns or more, else ValueError).
    With `swiglu_out`, silu(gate) * up of a [gate | up] weight, [1, N / 2] (gemv.gemv's). codes="fp4": e2m1 codes,
    e4m3 scale bytes and row_scale (float16 sums only)."""
    x = _one_row(x, 2 * qweight.shape[1], "int4_gemv_split")
    return _int4_split_launch(x, qweight, scale_zero, group_size,
                              (block_n, split_k, num_warps, row_tiles, f16_sums), None, swiglu_out, codes, row_scale)


def int4_gemv_split_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, qweight: torch.Tensor, scale_zero: torch.Tensor,
                            group_size: int, block_n: int = 64, split_k: int = 512, num_warps: int = 4,
                            row_tiles: int = 1, f16_sums: bool = False, *, swiglu_out: bool = False,
                            codes: str = "int4", row_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int4_gemv_split of RMSNorm(x + residual), x + residual) in one launch, as fp8_gemv_rmsnorm; `f16_sums`,
    `swiglu_out`, `codes` and `row_scale` as in int4_gemv_split."""
    return _normed_launch("int4_gemv_split_rmsnorm", x, residual, norm_weight, eps, 2 * qweight.shape[1],
                          lambda x, norm: _int4_split_launch(x, qweight, scale_zero, group_size,
                                                             (block_n, split_k, num_warps, row_tiles, f16_sums),
                                                             norm, swiglu_out, codes, row_scale))


def _int4_split_launch(x, qweight, scale_zero, group_size: int, config, norm, swiglu_out: bool = False,
                       codes: str = "int4", row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """config: (block_n, split_k, num_warps, row_tiles, f16_sums). norm: as in _fp8_launch."""
    check_int4(qweight, scale_zero, group_size, codes, row_scale)
    block_n, split_k, num_warps, row_tiles, f16_sums = config
    fp4 = _fp4_codes(codes)
    if fp4 and not f16_sums:
        raise ValueError("int4_gemv_split reads e2m1 codes (codes='fp4') with float16 sums only (f16_sums)")
    _check_blocks(block_n, 8, 1)
    (n, tiles), k = output_rows(qweight, block_n, swiglu_out), 2 * qweight.shape[1]
    sub = int4_split_sub(k, group_size, split_k)
    if sub is None:
        raise ValueError(f"int4_gemv_split cannot split K={k} in groups of {group_size} every {split_k} columns")
    if f16_sums and not int4_split_takes_f16_sums(split_k, sub):
        raise ValueError(f"int4_gemv_split sums in float16 over splits of at most {INT4_SPLIT_CHUNK} columns in "
                         f"sub-tiles of at least 16 (groups of 16 or more), not {split_k} columns in groups of "
                         f"{group_size}")
    padded = split_k & (split_k - 1) != 0
    if padded and not f16_sums:
        raise ValueError(f"int4_gemv_split holds a split of {split_k} columns (not a power of two) with float16 sums "
                         "only (f16_sums)")
    if qweight.stride(1) != 1 or qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        raise ValueError("int4_gemv_split needs rows of whole 32-bit words (K a multiple of 8, aligned rows)")
    row_blocks = triton.cdiv(tiles, row_tiles)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if split_k == k:  # one split: each program stores its own rows
        counts, partial = out, out
    else:
        counts = arrival_counts(x.device, row_blocks)
        if counts is None:
            raise ValueError(f"int4_gemv_split: {row_blocks} row blocks, more than the {ARRIVAL_SLOTS} arrival "
                             "counts (or the counts are not made yet inside a CUDA graph capture)")
        partial = torch.empty(k // split_k, qweight.shape[0], dtype=torch.float32, device=x.device)
    residual, norm_weight, summed, eps = norm or (None, x, x, 0.0)
    _int4_split_gemv_kernel[(k // split_k, row_blocks)](
        x, qweight.view(torch.int32), scale_zero, row_scale_pointer(row_scale, scale_zero), partial, counts, out, n,
        qweight.stride(0) // 4,
        x if residual is None else residual, norm_weight, summed, eps, K=k, GROUP=group_size, BLOCK_N=block_n,
        SPLIT_K=split_k, CHUNK=triton.next_power_of_2(split_k) if padded else min(split_k, INT4_SPLIT_CHUNK),
        SUB=sub, ROW_TILES=row_tiles,
        SCALE_BITS=SPLIT_SCALE_BITS, NORM=norm is not None, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
        num_stages=1, SWIGLU_OUT=swiglu_out, PRELOAD=min(preload_tiles(), 1), F16_SUMS=bool(f16_sums),
        F16_ASM=bool(f16_sums) and x.is_cuda, FP4=fp4, **pdl.launch(x.device))
    return out


def _normed_launch(name: str, x, residual, norm_weight, eps: float, k: int, launch):
    """(launch(x, norm), x + residual) for a norm-fused GEMV: the row, residual and the sum's tensor checked and
    made (gemv.normed_row_args), norm as the launches take it: (residual or None, norm weight, sum, eps)."""
    x, residual, summed = normed_row_args(_one_row(x, k, name), residual, norm_weight, k, name)
    return launch(x, (residual, norm_weight, summed, eps)), summed

def _one_row(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    """x as K contiguous values of a floating dtype the kernels read."""
    if x.numel() != k or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} needs x with {k} bfloat16, float16 or float32 values, got {x.dtype} "
                         f"{tuple(x.shape)}")
    return x.reshape(k).contiguous()


def _check_blocks(block_n: int, block_k: int, min_k: int) -> None:
    for name, value, least in (("block_n", block_n, 1), ("block_k", block_k, min_k)):
        if value < least or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {value}")


def _native_fp8(device: torch.device) -> bool:
    """Whether Triton converts float8_e4m3fn itself here (sm89+ and the interpreter); else bits are decoded."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _dequantize_int4_kernel(q_ptr, sz_ptr, rs_ptr, out_ptr, N, K, stride_qn, GROUP: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP4: tl.constexpr = False):
    """out[n, 2j + h] = (nibble h of q[n, j] - z[n, g]) * s[n, g] in float32, rounded once (FP4: e2m1(nibble) *
    float32(e4m3(s[n, g]) * rs[n])); both columns of a byte share g = 2j // GROUP since GROUP is even. Programs own
    BLOCK_R rows by BLOCK_C bytes."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    byte = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows < N)[:, None] & (byte < K // 2)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    b = tl.load(q_ptr + rows64 * stride_qn + byte[None, :], mask=ok, other=0).to(tl.int32)
    group = rows64 * (K // GROUP) + (2 * byte // GROUP)[None, :]
    row_scale = four_bit_row_scales(rs_ptr, rows, rows < N, FP4)
    s, z = four_bit_scale_and_zero(tl.load(sz_ptr + group, mask=ok, other=0), FP4, _rows_column(row_scale, FP4))
    low = (nibble_values(b & 15, FP4) - z) * s
    high = (nibble_values(b >> 4, FP4) - z) * s
    w = tl.join(low, high).reshape(BLOCK_R, 2 * BLOCK_C)
    out_cols = tl.program_id(1) * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
    out_ok = (rows < N)[:, None] & (out_cols < K)[None, :]
    tl.store(out_ptr + rows64 * K + out_cols[None, :], w.to(out_ptr.dtype.element_ty), mask=out_ok)


def dequantize_int4_cuda(qweight: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                         dtype: torch.dtype, block_r: int = 16, block_c: int = 128, codes: str = "int4",
                         row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """shardserve.kernels.quant_pack.dequantize_int4 in one launch (any device Triton runs on)."""
    check_int4(qweight, scale_zero, group_size, codes, row_scale)
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(n, block_r), triton.cdiv(k // 2, block_c))
    _dequantize_int4_kernel[grid](qweight, scale_zero, row_scale_pointer(row_scale, scale_zero), out, n, k,
                                  qweight.stride(0), GROUP=group_size, BLOCK_R=block_r, BLOCK_C=block_c,
                                  FP4=_fp4_codes(codes))
    return out


@triton.jit
def _quantize_rows_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_x, K: tl.constexpr, FP8_MAX: tl.constexpr,
                              BLOCK: tl.constexpr):
    """One program per row: the row's absolute maximum, then every value divided by max / FP8_MAX and rounded to
    float8_e4m3fn; the scale (max / FP8_MAX, at least 1e-12) goes to s_ptr[row]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_row + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), 1e-12)
    tl.store(s_ptr + row, scale)
    for k in range(0, K, BLOCK):
        x = tl.load(x_row + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * K + k + cols, q.to(q_ptr.dtype.element_ty), mask=k + cols < K)


def quantize_rows_fp8(x: torch.Tensor, fp8_max: float = 448.0, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]) with x ~ q * scale row by row: the dynamic
    per-token activation scaling of an FP8 matmul, in one launch."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8 needs a 2-D tensor with contiguous rows, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_fp8_kernel[(m,)](x, q, scale, x.stride(0), K=k, FP8_MAX=fp8_max, BLOCK=block, num_warps=4)
    return q, scale
