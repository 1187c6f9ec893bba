"""GEMMs of 16-bit activations with quantized weights, the weights read packed: int4 with scales and zero points
(w4a16) and fp8 with scales per row or per block of columns (w8a16). Layouts: shardserve.kernels.quant_pack.

These are for batches (more than one row); single rows take the GEMVs of quant_gemv.py. Each program owns a
BLOCK_M x BLOCK_N tile of the output and walks K in tiles of BLOCK_K columns: it loads the packed bytes of its
BLOCK_N weight rows, dequantizes them in registers to the activations' dtype and feeds tl.dot, which
accumulates in float32. Nothing the size of the weight is ever written, unlike dequantizing to a dense matrix
and calling cuBLAS.

Invariants the wrappers establish before launching:
- A weight tile lies inside one scale group: BLOCK_K divides the group, so each tile needs one scale (and
  zero) per weight row. Tiles run past K only over fp8's short last block or, with one group a row (any
  BLOCK_K), past a K that BLOCK_K does not divide: such ragged K is masked (EVEN_K off).
- With one group per row (int4 group == K, fp8 with one scale column) the tile is converted without its
  scale, exactly (int4 q - zero is a small integer, every e4m3 value is a bfloat16 and a float16), and the
  scale multiplies the float32 accumulator once at the end. Otherwise each weight is (q - zero) * scale or
  value * scale in float32, rounded once to the activations' dtype: the bits the dequantizers produce.
- K is a compile-time constant (as in the GEMVs; Triton's interpreter cannot loop to a run-time bound), M a
  run-time value that is not specialized on, so every batch size shares one compiled kernel.
- Ragged M and N are masked; masked weights load as 0 and masked activations as 0.0, so they add nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardserve.kernels.quant_layout import check_fp8, check_int4, fp8_groups
from shardserve.kernels.quant_pack import fit_block_k
from shardserve.kernels.triton.quant_gemv import (_e4m3_bits_to_float, _fp4_codes, _native_fp8, _rows_column,
                                                  four_bit_row_scales, four_bit_scale_and_zero, nibble_values,
                                                  row_scale_pointer)

# 4-bit tiles of 16 columns (8 bytes a row) give wrong products on an H200 (Triton 3, torch 2.11): relative errors
# near 1 at groups of 16, in the interpreter right. As the fused MoE's (fused_moe.FOUR_BIT_MIN_BLOCK_K), a tile over
# narrower groups spans this many columns, whole groups each with its own scale; where that cannot be (a group that
# does not divide it), GPUs refuse the GEMM and start-up timing keeps the layer's batches on dequantize + cuBLAS.
FOUR_BIT_MIN_BLOCK_K = 32

# Output tiles along M visited together, so that their weight tiles are read while still in L2.
GROUP_M = tl.constexpr(8)


class GemmConfig(NamedTuple):
    """Tile shape and launch parameters; block sizes are powers of two of at least 16 (tl.dot's smallest)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tiles worth trying for batches of up to so many rows (None: any larger batch), the default first. Small
# batches read weights as fast as they can, so they take narrow tiles that give every SM programs to run;
# large ones reuse each dequantized weight tile over many rows.
CANDIDATES: tuple[tuple[int | None, tuple[GemmConfig, ...]], ...] = (
    (16, (GemmConfig(16, 64, 128, 4, 4), GemmConfig(16, 32, 128, 4, 4), GemmConfig(16, 128, 64, 4, 4))),
    (64, (GemmConfig(64, 64, 128, 4, 4), GemmConfig(32, 64, 128, 4, 4), GemmConfig(64, 128, 64, 4, 4))),
    (256, (GemmConfig(64, 128, 64, 4, 4), GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 64, 64, 4, 4))),
    (None, (GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 128, 8, 3))),
)


def candidate_configs(m: int) -> tuple[GemmConfig, ...]:
    """The tiles worth trying for a batch of m rows, the default first."""
    for most, configs in CANDIDATES:
        if most is None or m <= most:
            return configs
    raise AssertionError("the last entry of CANDIDATES covers every batch")


def default_config(m: int) -> GemmConfig:
    return candidate_configs(m)[0]


@triton.jit
def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tile row, tile column) of this program: GROUP_M tile rows per band, walked column by column."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_band = GROUP_M * tiles_n
    first_m = (pid // per_band) * GROUP_M
    band_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % per_band) % band_m, (pid % per_band) // band_m


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(x_ptr, q_ptr, sz_ptr, rs_ptr, out_ptr, M, N, stride_xm, stride_qn, stride_om,
                      K: tl.constexpr, GROUP: tl.constexpr, ONE_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr = False):
    """out[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g], g = k // GROUP, q packed two columns a byte
    (column 2j in the low nibble of byte j), s and z in one word sz[n, g] (quant_gemv.scale_and_zero); FP4: q the
    e2m1 value of each code, sz the group's e4m3 byte times the row's scale rs[n] (quant_gemv.nibble_values,
    four_bit_scale_and_zero). The nibbles are interleaved back into column order in registers (join + reshape), so
    the bytes and x are both read contiguously along K. A tile lies inside one group, or (GROUP < BLOCK_K: groups
    narrower than FOUR_BIT_MIN_BLOCK_K) spans whole groups, each with its own scale."""
    tile_m, tile_n = _program_tile(M, N, BLOCK_M, BLOCK_N)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    feats = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, feat_ok = rows < M, feats < N
    cols = tl.arange(0, BLOCK_K)
    byte = tl.arange(0, BLOCK_K // 2)
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    q_tile = q_ptr + feats.to(tl.int64)[:, None] * stride_qn + byte[None, :]
    sz_feat = sz_ptr + feats.to(tl.int64) * (K // GROUP)
    feat_scale = four_bit_row_scales(rs_ptr, feats, feat_ok, FP4)
    if ONE_GROUP:
        row_scale, zero = four_bit_scale_and_zero(tl.load(sz_feat, mask=feat_ok, other=0), FP4, feat_scale)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
            b = tl.load(q_tile + k // 2, mask=feat_ok[:, None], other=0)
        else:
            x = tl.load(x_tile + k, mask=row_ok[:, None] & (k + cols < K)[None, :], other=0.0)
            b = tl.load(q_tile + k // 2, mask=feat_ok[:, None] & (k // 2 + byte < K // 2)[None, :], other=0)
        b = b.to(tl.int32)
        q = tl.join(nibble_values(b & 15, FP4), nibble_values(b >> 4, FP4)).reshape(BLOCK_N, BLOCK_K)
        if ONE_GROUP:
            w = q - zero[:, None]
        elif GROUP < BLOCK_K:  # [BLOCK_N, groups of the tile]
            groups = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
            inside = feat_ok[:, None] & (groups < K // GROUP)[None, :]
            words = tl.load(sz_feat[:, None] + groups[None, :], mask=inside, other=0)
            s, z = four_bit_scale_and_zero(words, FP4, _rows_column(feat_scale, FP4))
            w = ((q.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP) - z[:, :, None]) * s[:, :, None]).reshape(
                BLOCK_N, BLOCK_K)
        else:
            s, z = four_bit_scale_and_zero(tl.load(sz_feat + k // GROUP, mask=feat_ok, other=0), FP4, feat_scale)
            w = (q - z[:, None]) * s[:, None]
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    if ONE_GROUP:
        acc *= row_scale[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + feats[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & feat_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om,
                     K: tl.constexpr, GROUP: tl.constexpr, PER_ROW: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * float(w[n, k]) * s[n, k // GROUP]; PER_ROW: one scale a row (GROUP unused).
    w points at the raw bytes, reinterpreted as float8e4nv with NATIVE_FP8 and decoded bit by bit without it
    (to value / 256, so the scale is taken 256 times larger)."""
    tile_m, tile_n = _program_tile(M, N, BLOCK_M, BLOCK_N)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    feats = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, feat_ok = rows < M, feats < N
    cols = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    w_tile = w_ptr + feats.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    s_feat = s_ptr + feats.to(tl.int64) * (1 if PER_ROW else tl.cdiv(K, GROUP))
    unit = 1.0 if NATIVE_FP8 else 256.0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
            bits = tl.load(w_tile + k, mask=feat_ok[:, None], other=0)
        else:
            x = tl.load(x_tile + k, mask=row_ok[:, None] & (k + cols < K)[None, :], other=0.0)
            bits = tl.load(w_tile + k, mask=feat_ok[:, None] & (k + cols < K)[None, :], other=0)
        if NATIVE_FP8:
            w = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = _e4m3_bits_to_float(bits)
        if not PER_ROW:
            w = w * (tl.load(s_feat + k // GROUP, mask=feat_ok, other=0.0) * unit)[:, None]
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    if PER_ROW:
        acc *= (tl.load(s_feat, mask=feat_ok, other=0.0) * unit)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + feats[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & feat_ok[None, :])


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
              config: GemmConfig | None = None, codes: str = "int4", row_scale: torch.Tensor | None = None
              ) -> torch.Tensor:
    """x [M, K] (bfloat16 or float16) times the 4-bit weight (qweight [N, K // 2], scale_zero [N, K // group_size]:
    quant_pack's "int4" layout, or "fp4" with codes="fp4" and row_scale) transposed -> [M, N] in x's dtype. config:
    the tiles (default_config(M) if None); its block_k is narrowed to the largest power of two dividing group_size
    when the group is narrower, and for groups narrower than FOUR_BIT_MIN_BLOCK_K that divide it, widened to it."""
    check_int4(qweight, scale_zero, group_size, codes, row_scale)
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    x = _activations(x, k, "int4_gemm")
    config = _fitted(config or default_config(x.shape[0]), group_size, k)
    if config.block_k < FOUR_BIT_MIN_BLOCK_K and group_size < k and FOUR_BIT_MIN_BLOCK_K % group_size == 0:
        config = config._replace(block_k=FOUR_BIT_MIN_BLOCK_K)  # whole groups a tile, each with its own scale
    if x.is_cuda and config.block_k < FOUR_BIT_MIN_BLOCK_K:
        raise ValueError(f"int4_gemm on a GPU takes tiles of at least {FOUR_BIT_MIN_BLOCK_K} columns, not "
                         f"{config.block_k} (groups of {group_size}): narrower 4-bit tiles give wrong products there "
                         "(fused_moe.FOUR_BIT_MIN_BLOCK_K); such layers' batches dequantize")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _int4_gemm_kernel[_grid(x.shape[0], n, config)](
            x, qweight, scale_zero, row_scale_pointer(row_scale, scale_zero), out, x.shape[0], n, x.stride(0),
            qweight.stride(0), out.stride(0),
            K=k, GROUP=group_size, ONE_GROUP=group_size == k, EVEN_K=k % config.block_k == 0, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
            num_stages=config.num_stages, FP4=_fp4_codes(codes))
    return out


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int,
             config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16 or float16) times the fp8 weight [N, K]^T with scale [N, ceil(K / group_k)] -> [M, N]
    in x's dtype. group_k >= K is one scale per row. config as for int4_gemm (block_k fitted to group_k)."""
    check_fp8(weight, scale, group_k)
    n, k = weight.shape
    x = _activations(x, k, "fp8_gemm")
    per_row = fp8_groups(k, group_k) == 1
    config = _fitted(config or default_config(x.shape[0]), group_k, k)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _fp8_gemm_kernel[_grid(x.shape[0], n, config)](
            x, weight.view(torch.uint8), scale, out, x.shape[0], n, x.stride(0), weight.stride(0), out.stride(0),
            K=k, GROUP=k if per_row else group_k, PER_ROW=per_row, NATIVE_FP8=_native_fp8(x.device),
            EVEN_K=k % config.block_k == 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _activations(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    """x as [M, K] of a 16-bit float dtype with contiguous rows (tl.dot takes the weights in x's dtype)."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name} needs x of shape [M, {k}] in bfloat16 or float16, got {x.dtype} {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def _fitted(config: GemmConfig, group: int, k: int) -> GemmConfig:
    """config with block_k fitted to the scale group (quant_pack.fit_block_k: a tile stays inside one group; one
    group a row takes any width, ragged K masked). Raises ValueError for a config tl.dot cannot take."""
    config = GemmConfig(*config)
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"GEMM {name} must be a power of two >= 16, got {value}")
    return config._replace(block_k=fit_block_k(config.block_k, group, k))


def _grid(m: int, n: int, config: GemmConfig) -> tuple[int]:
    return (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
