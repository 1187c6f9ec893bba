"""FP4 (NVFP4 and MXFP4 checkpoints: weights/fp4.py): INT4's codes tensor holding e2m1 codes, an e4m3 byte a
group (`weight_scale`, uint8) and a float32 scale a row (`weight_row_scale`: NVFP4's global scale, or MXFP4's
power of two): W[n, k] = e2m1(q[n, k]) * float32(e4m3(scale[n, g]) * row_scale[n]) (kernels/quant_pack.py). The
4-bit kernels decode the codes by moving their bits into a float32 (codes="fp4"), and the split-K GEMV with float16
sums into float16 pairs, two shifts and two masks a pair of weights (quant_gemv._word_pair_sums); its float32
sums, which read nibbles as integers, are not offered for it.

On Hopper GPUs start-up also times the CUDA GEMV of kernels/cuda/fp4_products.py (whole rows a warp, each lane's
weight bytes loaded at once) for groups of 16: its forms are (rows a warp, warps a block), two
numbers where the split-K GEMV's are five. Its norm-fused form is two launches, the norm made once as the float16
pairs the GEMV reads, then the GEMV (timed against the norm kernel and the plain GEMV, as the others' forms with the
norm inside); it has no SwiGLU out.
"""

from __future__ import annotations

from typing import Any

import torch

from shardserve.kernels.quant_pack import fp4_positive_scales, fp4_scale_bytes, pack_int4, quantize_fp4
from shardserve.layers.quantization.int4 import Int4Format
from shardserve.weights.fp4 import Fp4Weight

# The length of a CUDA GEMV form (rows a warp, warps a block), beside the split-K GEMV's five numbers.
CUDA_FORM_LENGTH = 2


def is_cuda_form(split: tuple[int, ...] | None) -> bool:
    """Whether a chosen split form is the CUDA GEMV's."""
    return split is not None and len(split) == CUDA_FORM_LENGTH


class Fp4Format(Int4Format):
    kind = "fp4"
    scale_dtype = torch.uint8
    row_scaled = True
    stored = (Fp4Weight,)

    def read_stored(self, loaded: Any, r0: int, r1: int, c0: int, c1: int):
        codes, scale, row_scale = loaded.read_packed(r0, r1, c0, c1)
        codes, scale = fp4_positive_scales(codes, fp4_scale_bytes(scale))
        return pack_int4(codes), (scale, row_scale), None

    def quantize(self, values, group, block_rows=1, first_row=0):
        codes, scale, row_scale = quantize_fp4(values, group)
        return codes, (scale, row_scale)

    def split_forms(self, packed):
        """Int4Format's split-K forms with float16 sums (a fifth element 1), the only ones that read e2m1 codes;
        and the CUDA GEMV's forms where it runs (a Hopper GPU, SHARDSERVE_CUDA_KERNELS not off) and fits the shape."""
        from shardserve.kernels.cuda import runtime
        from shardserve.kernels.cuda.fp4_products import GEMV_CONFIGS, gemv_fits

        forms = [form for form in super().split_forms(packed) if len(form) == 5]
        if runtime.available(packed.device) and gemv_fits(packed.n, packed.k, packed.group) is None:
            forms += [tuple(config) for config in GEMV_CONFIGS]
        return forms

    def gemv(self, packed, layer, x, swiglu_out=False):
        if is_cuda_form(packed.gemv_split):
            if swiglu_out:
                raise ValueError("the CUDA fp4 GEMV has no SwiGLU-out form")
            from shardserve.kernels.cuda.fp4_products import fp4_gemv

            return fp4_gemv(x, layer.weight, layer.weight_scale, layer.weight_row_scale.data, *packed.gemv_split,
                            next_early=getattr(layer, "feeds_next_directly", False))
        return super().gemv(packed, layer, x, swiglu_out)

    def normed_gemv(self, packed, layer, x, residual, norm_weight, eps, swiglu_out=False):
        if is_cuda_form(packed.gemv_split):
            if swiglu_out:
                raise ValueError("the CUDA fp4 GEMV has no SwiGLU-out form")
            from shardserve.kernels.cuda.fp4_products import fp4_gemv_rmsnorm

            return fp4_gemv_rmsnorm(x, residual, norm_weight, eps, layer.weight, layer.weight_scale,
                                    layer.weight_row_scale.data, *packed.gemv_split,
                                    next_early=getattr(layer, "feeds_next_directly", False))
        return super().normed_gemv(packed, layer, x, residual, norm_weight, eps, swiglu_out)

    def swiglu_out_config(self, packed, layer):
        return None if is_cuda_form(packed.gemv_split) else super().swiglu_out_config(packed, layer)
