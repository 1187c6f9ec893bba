"""INT4 (GPTQ and AutoRound checkpoints): `weight` uint8 [N, K / 2], column 2j in the low nibble of byte j, 2j+1 in
the high one; `weight_scale` int32 [N, K / group], each group's scale and zero point in one word
(kernels/quant_pack.py's pack_scale_zero): W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = k // group. An
act-order checkpoint's columns are sorted by group at load; the layer's `input_perm` [K] then says which input
feature each column holds, and inputs are gathered in that order.

Products: one row by the tiled GEMV or, where start-up timing found it faster, the split-K GEMV (float32 or
float16-pair sums) of kernels/triton/quant_gemv.py; batches by the fused GEMM or dequantize + cuBLAS.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from shardserve import envs
from shardserve.kernels.quant_pack import (dequantize_int4, pack_int4, pack_scale_zero, reference_weight64,
                                           unpack_scale_zero)
from shardserve.layers.quantization.base import QuantFormat
from shardserve.weights.quantized import GptqWeight

# (block_n, split_k, num_warps, row_tiles) of the 4-bit split-K GEMV (quant_gemv.int4_gemv_split), timed against
# GEMV_CANDIDATES at start-up: the fastest of grids (block_n 8-256, split_k 256-4096, 4 or 8 warps, 1-4 row tiles)
# on each of Llama-3-8B's projections on an H100. Only splits the kernel holds x for (at most INT4_SPLIT_CHUNK
# columns): wider ones (whole rows of gate/up, 2,048 columns of down) were faster alone, by 0.4-0.9 us, and made
# the step slower (2.494-2.502 ms against 2.431-2.444, one H100). None spills registers.
INT4_SPLIT_CANDIDATES = ((128, 512, 4, 1), (64, 512, 4, 1), (64, 512, 4, 4), (32, 512, 4, 1), (64, 1024, 4, 1))
# Start-up also times each INT4_SPLIT_CANDIDATES form with two words' products summed in float16 pairs (a fifth
# element 1: quant_gemv's F16_SUMS on the split-K GEMV), about a fifth fewer instructions a weight: on an H100 they
# won every Llama-3-8B shape but o (a tie) and took the 4-bit step from 2.409 to 2.291 ms
# (docs/benchmarks-notebook.md). The start-up check against float64 keeps them out of float32 models.
# SHARDSERVE_INT4_GEMV_SUMS=float32 (or float16) times only that kind; auto, the default, both.
INT4_SUMS_ENV = envs.INT4_GEMV_SUMS.name
# (block_n, num_warps) of the split-K forms start-up times, with float16 sums, where K takes no power-of-two split
# (quant_gemv.int4_padded_splits: Nemotron-3's 2688 and 3712 columns).
PADDED_SPLIT_ROWS = ((64, 4), (128, 4), (32, 4))


def quantize_int4(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (packed uint8 [N, K / 2], scale-and-zero words int32 [N, K / group]): asymmetric, each
    row's group spanning its minimum to maximum in 16 levels."""
    n, k = values.shape
    blocks = values.float().reshape(n, -1, group)
    low, high = blocks.amin(dim=2).clamp(max=0), blocks.amax(dim=2).clamp(min=0)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    scale_zero = pack_scale_zero(scale, (-low / scale).round().clamp(0, 15))
    scale, zero = unpack_scale_zero(scale_zero)  # the scale as the word holds it
    codes = (blocks / scale[:, :, None] + zero[:, :, None]).round().clamp(0, 15).to(torch.uint8)
    return pack_int4(codes.reshape(n, k)), scale_zero


class Int4Format(QuantFormat):
    kind = "int4"
    per_byte = 2
    scale_dtype = torch.int32
    stored = (GptqWeight,)

    def fits(self, k, group):
        if k % 2 or group % 2:
            return f"4-bit codes pack in pairs of columns: {k} input features in groups of {group} do not"
        return super().fits(k, group)

    def read_stored(self, loaded: Any, r0: int, r1: int, c0: int, c1: int):
        codes, scale, zero, perm = loaded.read_packed(r0, r1, c0, c1)
        return pack_int4(codes), pack_scale_zero(scale, zero), perm

    def quantize(self, values, group, block_rows=1, first_row=0):
        return quantize_int4(values, group)

    def dequantize(self, codes, scales, group, dtype, row_scale=None):
        return dequantize_int4(codes, scales, group, dtype, codes=self.kind, row_scale=row_scale)

    def reference64(self, codes, scales, group, row_scale=None):
        return reference_weight64(self.kind, codes, scales, group, row_scale)

    def gemv(self, packed, layer, x, swiglu_out=False):
        from shardserve.kernels.triton.quant_gemv import int4_gemv, int4_gemv_split

        rows = _row_scale(layer)
        if packed.gemv_split is not None:
            return int4_gemv_split(x, layer.weight, layer.weight_scale, packed.group, *packed.gemv_split,
                                   swiglu_out=swiglu_out, codes=self.kind, row_scale=rows)
        return int4_gemv(x, layer.weight, layer.weight_scale, packed.group, *packed.gemv_config, codes=self.kind,
                         row_scale=rows)

    def normed_gemv(self, packed, layer, x, residual, norm_weight, eps, swiglu_out=False):
        from shardserve.kernels.triton.quant_gemv import int4_gemv_rmsnorm, int4_gemv_split_rmsnorm

        rows = _row_scale(layer)
        if packed.gemv_split is not None:
            return int4_gemv_split_rmsnorm(x, residual, norm_weight, eps, layer.weight, layer.weight_scale,
                                           packed.group, *packed.gemv_split, swiglu_out=swiglu_out,
                                           codes=self.kind, row_scale=rows)
        return int4_gemv_rmsnorm(x, residual, norm_weight, eps, layer.weight, layer.weight_scale, packed.group,
                                 *packed.gemv_config, codes=self.kind, row_scale=rows)

    def gemm(self, packed, layer, x, config):
        from shardserve.kernels.triton.quant_gemm import int4_gemm

        return int4_gemm(x, layer.weight, layer.weight_scale, packed.group, config, codes=self.kind,
                         row_scale=_row_scale(layer))

    def swiglu_out_config(self, packed, layer):
        """The split-K GEMV's, where start-up chose it: the tiled 4-bit GEMV has no SwiGLU-out form."""
        return packed.gemv_split

    def split_forms(self, packed):
        """split_forms of the layer's K and group."""
        return split_forms(packed.k, packed.group)


def _row_scale(layer) -> torch.Tensor | None:
    """The layer's scales a row (fp4's), or None."""
    row_scale = getattr(layer, "weight_row_scale", None)
    return None if row_scale is None else row_scale.data


def split_forms(k: int, group: int) -> list[tuple[int, ...]]:
    """Each of INT4_SPLIT_CANDIDATES that fits K columns in groups of `group`, with float32 sums, float16 sums (a
    fifth element 1, where int4_split_takes_f16_sums) or both, as SHARDSERVE_INT4_GEMV_SUMS says (auto: both); where
    none fits, padded splits (int4_padded_splits) with float16 sums."""
    from shardserve.kernels.triton.quant_gemv import int4_padded_splits, int4_split_sub, int4_split_takes_f16_sums

    sums = envs.INT4_GEMV_SUMS.get()
    forms: list[tuple[int, ...]] = []
    for config in INT4_SPLIT_CANDIDATES:
        sub = int4_split_sub(k, group, config[1])
        if sub is None:
            continue
        if sums != "float16":
            forms.append(config)
        if int4_split_takes_f16_sums(config[1], sub) and sums != "float32":
            forms.append((*config, 1))
    if not forms and sums != "float32":  # K of no power-of-two split: padded splits with float16 sums
        for split_k, (block_n, warps) in itertools.product(int4_padded_splits(k), PADDED_SPLIT_ROWS):
            if int4_split_sub(k, group, split_k) is not None:
                forms.append((block_n, split_k, warps, 1, 1))
    return forms
