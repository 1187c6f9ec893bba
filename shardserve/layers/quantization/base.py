"""What every quantization format of packed weights provides (the package docstring lists them). The bit layouts
themselves, and their dequantizers and float64 definitions, are in kernels/quant_pack.py beside the kernels that read
them; a format says which of them a layer holds, how it loads, and which kernels compute with it."""

from __future__ import annotations

from typing import Any

import torch

from shardserve.layers.linear import empty_parameter

# (block_n, block_k, num_warps, num_stages) of the single-row kernels until start-up timing picks per shape.
# The last two were the fastest FP8 GEMVs on an H100 for Llama-3-8B's q/k/v, o and gate/up shapes (gate/up at
# 3.0 TB/s) in a grid of block_n 4-32, block_k 1024-4096, 4 or 8 warps and 2-4 stages, timed as
# benchmarks/gemv_shapes.py --packed fp8 times them.
DEFAULT_GEMV = (8, 512, 4, 3)
GEMV_CANDIDATES = ((8, 512, 4, 3), (4, 1024, 8, 4), (16, 256, 4, 2), (8, 1024, 8, 3), (8, 1024, 4, 3),
                   (8, 2048, 8, 3), (16, 1024, 8, 3), (4, 2048, 8, 4), (4, 4096, 8, 4), (4, 4096, 8, 2))


class QuantFormat:
    """One format's tensors, loading, values and products. A packed weight is `codes` [..., N, K / per_byte] of
    codes_dtype and `scales` [..., N, K / group] of scale_dtype; the leading dimensions are an expert block's. The
    product methods take a linear layer's PackedWeights (its chosen configurations) and the layer (its tensors)."""

    kind = ""
    per_byte = 1  # weights a byte of codes holds
    codes_dtype = torch.uint8
    scale_dtype = torch.float32
    stored: tuple[type, ...] = ()  # the checkpoint tensors (weights/quantized.py, weights/fp4.py) it reads
    # Whether a weight also holds a float32 scale a row [..., N] (`{name}_row_scale` beside `{name}_scale`): then
    # read_stored and quantize give their scales as (group scales, row scales).
    row_scaled = False

    # -- tensors and loading -------------------------------------------------------------------------------------

    def fits(self, k: int, group: int) -> str:
        """Why K input features in groups of `group` cannot be held ("" where they can)."""
        return "" if k % group == 0 else f"{k} input features are not whole groups of {group}"

    def codes(self, *shape: int, device) -> torch.nn.Parameter:
        """Empty codes for a weight of `shape` (..., N, K)."""
        *lead, k = shape
        return empty_parameter(*lead, k // self.per_byte, dtype=self.codes_dtype, device=device)

    def scales(self, *shape: int, group: int, device) -> torch.nn.Parameter:
        """Empty scales for a weight of `shape` (..., N, K) in groups of `group` columns (the last may be short)."""
        *lead, k = shape
        return empty_parameter(*lead, -(-k // group), dtype=self.scale_dtype, device=device)

    def row_scales(self, *shape: int, device) -> torch.nn.Parameter | None:
        """Empty row scales for a weight of `shape` (..., N, K), or None where the format has none."""
        *lead, _ = shape
        return empty_parameter(*lead, dtype=torch.float32, device=device) if self.row_scaled else None

    def copy_scales(self, scale: torch.Tensor, row_scale: torch.Tensor | None, scales) -> None:
        """Copy what read_stored or quantize gave as scales into a weight's scale (and row scale) rows."""
        parts = scales if self.row_scaled else (scales,)
        for target, part in zip((scale, row_scale), parts):
            if tuple(part.shape) != tuple(target.shape):
                raise ValueError(f"scales of shape {tuple(part.shape)} where the layer holds {tuple(target.shape)}")
            target.copy_(part)

    def read_stored(self, loaded: Any, r0: int, r1: int, c0: int, c1: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows [r0, r1) and columns [c0, c1) of a checkpoint's stored tensor in this format: (codes, scales, the
        input permutation of act order or None)."""
        raise NotImplementedError

    def quantize(self, values: torch.Tensor, group: int, block_rows: int = 1, first_row: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """float [N, K] -> (codes, scales) of this format, each row's group scaled to its own range."""
        raise NotImplementedError

    # -- what the tensors encode -----------------------------------------------------------------------------------

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype,
                   row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The [N, K] values in dtype (float32 products rounded once)."""
        raise NotImplementedError

    def reference64(self, codes: torch.Tensor, scales: torch.Tensor, group: int,
                    row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """float64 [N, K], written from the layout's definition (kernels/quant_pack.reference_weight64, beside
        the kernels that implement it) rather than by the dequantizer: what the start-up checks compare every
        kernel with."""
        raise NotImplementedError

    # -- a linear layer's products ---------------------------------------------------------------------------------

    def gemv(self, packed, layer, x: torch.Tensor, swiglu_out: bool = False) -> torch.Tensor:
        """The one-row product by the configuration start-up chose (packed.gemv_config, packed.gemv_split)."""
        raise NotImplementedError

    def normed_gemv(self, packed, layer, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, swiglu_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(the one-row product of RMSNorm(x + residual), x + residual) in one launch."""
        raise NotImplementedError

    def gemm(self, packed, layer, x: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
        """A batch's product by the fused GEMM in `config`'s tiles (kernels/triton/quant_gemm.py)."""
        raise NotImplementedError

    def swiglu_out_config(self, packed, layer) -> tuple[int, ...] | None:
        """The chosen configuration whose launch can give silu(gate) * up itself, or None where none can."""
        return None

    def tiled_candidates(self, packed, scale_rows: int = 1) -> tuple[tuple[int, ...], ...]:
        """The tiled single-row configurations start-up times for a packed shape (scale_rows: Fp8Format's)."""
        return GEMV_CANDIDATES

    def split_forms(self, packed) -> list[tuple[int, ...]]:
        """The split-K single-row configurations start-up also times (none unless the format has that kernel)."""
        return []

    def scale_rows(self, codes: torch.Tensor, scales: torch.Tensor, k: int, group: int) -> int:
        """How many aligned rows share their scales, where a kernel can use it (1: none assumed)."""
        return 1
