"""FP8: `weight` float8_e4m3fn [N, K]; `weight_scale` float32 [N, ceil(K / group)]: W[n, k] = weight[n, k] *
weight_scale[n, k // group], with group the checkpoint's scale block's columns (128) or K (one scale a row:
per-channel and per-tensor checkpoints, and float checkpoints quantized at load with --quantization fp8).

Products: one row by the tiled GEMV of kernels/triton/quant_gemv.py, in float32 sums or (one scale a row, or rows
that share their groups' scales: a block-scaled checkpoint's 128-row blocks) float16 pairs; batches by
torch._scaled_mm where one scale a row allows it (PackedWeights.scaled_mm), else the fused GEMM or dequantize +
cuBLAS (packed.py decides).
"""

from __future__ import annotations

from typing import Any

import torch

from shardserve import envs
from shardserve.kernels.quant_pack import dequantize_fp8, reference_weight64
from shardserve.layers.quantization.base import GEMV_CANDIDATES, QuantFormat
from shardserve.weights.quantized import Fp8Weight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# FP8 GEMVs with one scale a row (or rows that share their groups' scales) are also timed in these forms:
# GEMV_CANDIDATES' elements and a fifth, partial sums in float16 pairs (quant_gemv's F16_SUMS), about half the
# instructions a weight. On an H100's 132 SMs the two kinds time within 3% of each other alone on Llama-3-8B's
# shapes, and whole FP8 steps with start-up's choices among both took 3.059 ms against 3.050 with float32 sums
# only. On 92 of its SMs, where each SM must issue for as many bytes a second as an H200's, float16 sums were 6-11%
# faster on every shape (benchmarks/gemv_shapes.py --packed fp8 --sms 92; these were the fastest there) and the
# whole step took 3.240 ms against 3.436 (profile_decode.py --sms 92; docs/benchmarks-notebook.md).
# SHARDSERVE_FP8_GEMV_SUMS=auto (default: both kinds), float32 or float16 (one kind).
FP8_F16_CANDIDATES = ((16, 1024, 4, 2, 1), (16, 512, 8, 2, 1), (16, 512, 4, 3, 1), (32, 256, 4, 3, 1),
                      (16, 1024, 4, 3, 1), (8, 1024, 4, 3, 1))
FP8_SUMS_ENV = envs.FP8_GEMV_SUMS.name


def quantize_fp8(values: torch.Tensor, group: int, block_rows: int = 1, first_row: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn codes, float32 scales [N, K / group]): each row's group scaled so its
    largest magnitude is FP8's largest value; with block_rows, each group of block_rows rows (counted from the
    checkpoint's row 0, these being its rows from first_row) scaled so together, one scale row a row."""
    n, k = values.shape
    blocks = values.float().reshape(n, -1, group)
    amax = blocks.abs().amax(dim=2)
    if block_rows > 1:  # the rows padded with zeros to whole blocks, each block's maximum, back to the rows
        before = first_row % block_rows
        after = -(before + n) % block_rows
        padded = torch.nn.functional.pad(amax, (0, 0, before, after)).reshape(-1, block_rows, amax.shape[1])
        amax = padded.amax(dim=1).repeat_interleave(block_rows, dim=0)[before:before + n]
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (blocks / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(n, k), scale


class Fp8Format(QuantFormat):
    kind = "fp8"
    codes_dtype = torch.float8_e4m3fn
    stored = (Fp8Weight,)

    def read_stored(self, loaded: Any, r0: int, r1: int, c0: int, c1: int):
        values, scale = loaded.read_packed(r0, r1, c0, c1)
        return values, scale, None

    def quantize(self, values, group, block_rows=1, first_row=0):
        return quantize_fp8(values, group, block_rows, first_row)

    def dequantize(self, codes, scales, group, dtype, row_scale=None):
        return dequantize_fp8(codes, scales, group, dtype)

    def reference64(self, codes, scales, group, row_scale=None):
        return reference_weight64(self.kind, codes, scales, group)

    def gemv(self, packed, layer, x, swiglu_out=False):
        from shardserve.kernels.triton.quant_gemv import fp8_gemv

        return fp8_gemv(x, layer.weight, layer.weight_scale, packed.group, *packed.gemv_config, swiglu_out=swiglu_out)

    def normed_gemv(self, packed, layer, x, residual, norm_weight, eps, swiglu_out=False):
        from shardserve.kernels.triton.quant_gemv import fp8_gemv_rmsnorm

        return fp8_gemv_rmsnorm(x, residual, norm_weight, eps, layer.weight, layer.weight_scale, packed.group,
                                *packed.gemv_config, swiglu_out=swiglu_out)

    def gemm(self, packed, layer, x, config):
        from shardserve.kernels.triton.quant_gemm import fp8_gemm

        return fp8_gemm(x, layer.weight, layer.weight_scale, packed.group, config)

    def swiglu_out_config(self, packed, layer):
        config = packed.gemv_config
        if len(config) > 4 and config[4] and packed.scale_rows(layer) > 1:  # float16 sums of groups: rows of one half
            return None
        return config

    def tiled_candidates(self, packed, scale_rows=1):
        """GEMV_CANDIDATES, and with one scale a row, or in groups whose scales runs of `scale_rows` rows share,
        FP8_F16_CANDIDATES (float16 sums; of groups, those of at most scale_rows rows a program) too, or only one
        kind, as SHARDSERVE_FP8_GEMV_SUMS says (auto: both)."""
        from shardserve.kernels.quant_layout import fp8_groups

        if fp8_groups(packed.k, packed.group) == 1:
            f16 = FP8_F16_CANDIDATES
        else:
            f16 = tuple(config for config in FP8_F16_CANDIDATES if config[0] <= scale_rows)
            if not f16:
                return GEMV_CANDIDATES
        sums = envs.FP8_GEMV_SUMS.get()
        return (GEMV_CANDIDATES if sums != "float16" else ()) + (f16 if sums != "float32" else ())

    def scale_rows(self, codes, scales, k, group):
        """In groups: the rows each aligned run of which shares its scales (quant_gemv.rows_share_scales, up to
        32), which the float16 sums of groups need."""
        from shardserve.kernels.quant_layout import fp8_groups
        from shardserve.kernels.triton.quant_gemv import rows_share_scales

        return rows_share_scales(scales) if fp8_groups(k, group) > 1 and not scales.is_meta else 1
