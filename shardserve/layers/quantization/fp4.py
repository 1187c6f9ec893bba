"""FP4 (NVFP4 and MXFP4 checkpoints: weights/fp4.py): INT4's tensors holding e2m1 codes, each word the group's
float32 scale (NVFP4's global scale folded in): W[n, k] = e2m1(q[n, k]) * scale[n, g]. The 4-bit kernels decode the
codes by moving their bits into a float32 (codes="fp4"), and the split-K GEMV with float16 sums into float16 pairs,
two shifts and two masks a pair of weights (quant_gemv._word_pair_sums); its float32 sums, which read nibbles as
integers, are not offered for it.
"""

from __future__ import annotations

from typing import Any

import torch

from shardserve.kernels.quant_pack import E2M1_VALUES, pack_fp4_scales, pack_int4
from shardserve.layers.quantization.int4 import Int4Format
from shardserve.weights.fp4 import Fp4Weight


def quantize_fp4(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (packed e2m1 codes uint8 [N, K / 2], float32 scale words int32 [N, K / group]): each row's
    group scaled so its largest magnitude is e2m1's largest value (6), each value rounded to the nearest code."""
    n, k = values.shape
    blocks = values.float().reshape(n, -1, group)
    scale = (blocks.abs().amax(dim=2) / max(E2M1_VALUES)).clamp(min=torch.finfo(torch.float32).tiny)
    table = torch.tensor(E2M1_VALUES, device=values.device)
    codes = (blocks / scale[:, :, None]).unsqueeze(-1).sub(table).abs().argmin(dim=-1)
    return pack_int4(codes.reshape(n, k)), pack_fp4_scales(scale)


class Fp4Format(Int4Format):
    kind = "fp4"
    stored = (Fp4Weight,)

    def read_stored(self, loaded: Any, r0: int, r1: int, c0: int, c1: int):
        codes, scale = loaded.read_packed(r0, r1, c0, c1)
        return pack_int4(codes), pack_fp4_scales(scale), None

    def quantize(self, values, group, block_rows=1, first_row=0):
        return quantize_fp4(values, group)

    def split_forms(self, packed):
        """Int4Format's split-K forms with float16 sums (a fifth element 1), the only ones that read e2m1 codes."""
        return [form for form in super().split_forms(packed) if len(form) == 5]
