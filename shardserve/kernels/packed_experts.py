"""A mixture of experts' weights kept packed: every expert's w13 [2I, H] and w2 [H, I] in one of the layouts of
kernels/quant_pack.py, stacked over the experts. No Triton here: what the fused kernel reads
(kernels/triton/fused_moe.py), what the host-grouped fallback dequantizes per expert, and the float64 reference.

- fp8: w float8_e4m3fn [E, N, K], scale float32 [E, N, K / group]: W[e, n, k] = w[e, n, k] * scale[e, n, k // group].
- int4: w uint8 [E, N, K / 2] (column 2j in the low nibble of byte j), scale int32 [E, N, K / group] holding each
  group's scale and zero point in one word (quant_pack.pack_scale_zero):
  W[e, n, k] = (q[e, n, k] - zero[e, n, g]) * scale[e, n, g], g = k // group.
- fp4: int4's codes holding e2m1 codes, scale uint8 [E, N, K / group] (e4m3 bytes) and row13 / row2 float32 [E, N]:
  W[e, n, k] = e2m1(q[e, n, k]) * float32(e4m3(scale[e, n, g]) * row[e, n]).
group divides K (K itself: one scale a row). w13's gate rows and up rows each keep their own scales (rows of the
scale tensors follow the weight's rows). Non-gated experts (activation "relu2" or "silu", NemotronH's) hold only
their up rows in w13 [E, I, H]: each expert is w2 act(w13 x).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardserve.kernels.quant_pack import dequantize_fp8, dequantize_int4, reference_weight64


class PackedExperts(NamedTuple):
    kind: str  # "fp8", "int4" or "fp4"
    w13: torch.Tensor
    scale13: torch.Tensor  # int4: scale-and-zero words
    group13: int
    w2: torch.Tensor
    scale2: torch.Tensor
    group2: int
    activation: str = "swiglu"  # or "relu2" / "silu": non-gated experts (w13 holds the up rows only)
    row13: torch.Tensor | None = None  # fp4: a float32 scale a row [E, N]
    row2: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2 if self.gated else self.w13.shape[1]

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H] or non-gated [I, H], w2 [H, I]) dequantized to dtype (float32 products, rounded once)."""
        if self.kind == "fp8":
            return (dequantize_fp8(self.w13[e], self.scale13[e], self.group13, dtype),
                    dequantize_fp8(self.w2[e], self.scale2[e], self.group2, dtype))
        return (dequantize_int4(self.w13[e], self.scale13[e], self.group13, dtype, self.kind, _row(self.row13, e)),
                dequantize_int4(self.w2[e], self.scale2[e], self.group2, dtype, self.kind, _row(self.row2, e)))

    def reference(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's weights in float64, written from the layouts' definitions (not the dequantizers)."""
        return (reference_weight64(self.kind, self.w13[e], self.scale13[e], self.group13, _row(self.row13, e)),
                reference_weight64(self.kind, self.w2[e], self.scale2[e], self.group2, _row(self.row2, e)))

    def describe(self) -> str:
        gate = "" if self.gated else f", non-gated {self.activation}"
        return f"{self.kind} (groups of {self.group13} and {self.group2}{gate})"


def _row(rows: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if rows is None else rows[e]
