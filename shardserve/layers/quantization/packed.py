"""The packed layer: a linear layer whose quantized weights stay packed (layers/quantization/'s formats: FP8, a byte
a weight; 4-bit, half a byte), and the products it runs.

A packed layer's parameters, on this rank, are `weight` (the codes) and `weight_scale`, and for act-order 4-bit
checkpoints `input_perm`; what they hold, how they load and which kernels compute with them is its format's (fp8.py,
int4.py, fp4.py). Which layers are packed: selection.py; the check against float64 at start-up: check.py; the
choice of the single-row kernels: gemv_choice.py, and of the batch kernels: gemm_choice.py.

Rows of a fused layer (q/k/v, gate/up) stack their parts' rows, each with its own scales, so sharding packed weights
is the dense rule: column-parallel layers own rows, row-parallel layers own columns, and a rank's columns must be
whole scale groups. A layer whose slice would split a group is not packed: it keeps the values it encodes in the
compute dtype (logged by name), exactly as on CPUs. A GPTQ checkpoint's quantized LM head (`lm_head: true`) is packed
too, by vocabulary rows like a column-parallel layer (layers/embedding.py).

Products: a single row runs the Triton GEMVs of kernels/triton/quant_gemv.py; batches run torch._scaled_mm on FP8
with one scale a row and dynamic per-token activation scales (Hopper and Ada), else, per bucket of row counts
(BATCH_LIMITS), the Triton GEMM of kernels/triton/quant_gemm.py that reads the packed weights (16-bit activations,
only where start-up timing chose it: gemm_choice.py) or the weight dequantized to the compute dtype and cuBLAS. Every
distinct packed shape is checked against float64 at start-up on the paths it runs (check.check_packed); a failure
unpacks every packed layer (WARNING), so no rank serves a wrong product.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from shardserve import envs
from shardserve.layers.linear import KernelLinear, as_tensor
from shardserve.layers.quantization import format_of
from shardserve.layers.quantization.base import DEFAULT_GEMV
from shardserve.layers.quantization.fp8 import FP8_MAX
from shardserve.weights.quantized import QuantScheme

logger = logging.getLogger(__name__)


# Batches by row count: at most 16, 64, 256, 512 or 1024 rows, or more (a full decode batch of 512 sequences has
# a bucket of its own: on an H100 the 4-bit GEMM beat dequantizing there on some shapes and not at 1024). Each
# bucket of a layer runs the fused GEMM with its own tiles, or dequantize + cuBLAS (PackedWeights.batch_gemms).
BATCH_LIMITS = (16, 64, 256, 512, 1024)
BATCH_BUCKETS = len(BATCH_LIMITS) + 1


def batch_bucket(rows: int) -> int:
    """Index of the bucket a batch of `rows` rows falls in (0 for 16 rows or fewer)."""
    return bisect_left(BATCH_LIMITS, rows)


# A packed layer's parameters besides `weight`: filled by the weight's loader, along with it.
PACKED_PARTS = ("weight_scale", "weight_row_scale", "input_perm")
QUANTIZED_LAYERS_ENV = envs.QUANTIZED_LAYERS.name
QUANTIZED_LAYERS_MODES = envs.QUANTIZED_LAYERS.choices


def quantized_layers_mode() -> str:
    """SHARDSERVE_QUANTIZED_LAYERS: auto (a checkpoint's quantized layers packed on GPUs, dequantized on CPUs),
    packed (on CPUs too: each product dequantizes) or dequantized (everywhere)."""
    return envs.QUANTIZED_LAYERS.get()


FP8_MATMUL_ENV = envs.FP8_MATMUL.name
FP8_MATMUL_KERNELS = envs.FP8_MATMUL.choices


def fp8_matmul_kernel() -> str:
    """SHARDSERVE_FP8_MATMUL: how batches multiply FP8 weights with one scale a row on GPUs with FP8 tensor cores:
    "scaled_mm" (torch._scaled_mm, the default) or "triton" (the fused GEMM that the other layouts use)."""
    return envs.FP8_MATMUL.get()


@dataclass(frozen=True)
class PackedLayout:
    kind: str  # "fp8", "int4" or "fp4" (e2m1 codes in int4's nibbles: kernels/quant_pack.py)
    group: int  # input columns one scale covers on this rank; 0: all of them
    act_order: bool = False  # int4: columns may come sorted by group (input_perm)
    # FP8 blocks: output rows one scale covers (a block-scaled checkpoint's 128); float weights quantized at load
    # take one scale a block so, as such a checkpoint's do.
    block_rows: int = 1

    def describe(self) -> str:
        return f"{self.kind} ({f'groups of {self.group}' if self.group else 'one scale a row'})"

    @classmethod
    def of_checkpoint(cls, scheme: QuantScheme) -> "PackedLayout":
        """How a quantized checkpoint's layers are kept: FP8 scaled per block's columns or per row, GPTQ per group,
        NVFP4 and MXFP4 per group as e2m1 codes."""
        kind = "fp8" if scheme.method == "fp8" else "fp4" if scheme.e2m1 else "int4"
        block_rows = scheme.weight_block[0] if kind == "fp8" and scheme.weight_block else 1
        return cls(kind, scheme.group_columns, scheme.act_order, block_rows)


class PackedWeights:
    """The packed parameters of one layer (set as layer.packed): loading into them, and the layer's product."""

    def __init__(self, layer: KernelLinear, layout: PackedLayout, device: torch.device | str) -> None:
        n, k = layer.weight.shape
        group = layout.group or k
        self.format = format_of(layout.kind)
        if self.format.fits(k, group):
            raise ValueError(f"{layout.describe()} does not fit {k} input features: {self.format.fits(k, group)}")
        self.layout, self.n, self.k, self.group = layout, n, k, group
        self.compute_dtype = layer.weight.dtype
        self.gemv_config = DEFAULT_GEMV
        # 4-bit only: the split-K GEMV's configuration (INT4_SPLIT_CANDIDATES), or fp4's CUDA GEMV's (Fp4Format),
        # where start-up timing found it faster than every tiled one; None runs the tiled GEMV (gemv_config).
        self.gemv_split: tuple[int, ...] | None = None
        # One-row products of a normed input (the QKV and gate/up projections) with the norm inside the GEMV:
        # set by start-up timing where that measured faster than the norm kernel and the GEMV.
        self.norm_fused = False
        # Per batch bucket, the fused GEMM's (block_m, block_n, block_k, num_warps, num_stages), or None for
        # dequantize + cuBLAS: None until start-up timing picks (gemm_choice.py), and always on CPUs.
        self.batch_gemms: tuple[tuple[int, ...] | None, ...] = (None,) * BATCH_BUCKETS
        device = torch.device(device)
        self.device = device
        # Batches on FP8 tensor cores (compute capability 8.9 on): FP8 with one scale a row, in 16-wide shapes.
        self.scaled_mm = (layout.kind == "fp8" and group == k and k % 16 == 0 and n % 16 == 0
                          and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
                          and fp8_matmul_kernel() == "scaled_mm")
        loader = layer.weight.weight_loader
        layer.weight = self.format.codes(n, k, device=device)
        if self.format.per_byte > 1:
            # Identity until an act-order checkpoint's columns arrive sorted; gathering by it is then exact.
            layer.input_perm = nn.Parameter(torch.arange(k, device=device), requires_grad=False) \
                if layout.act_order else None
        layer.weight_scale = self.format.scales(n, k, group=group, device=device)
        layer.weight_row_scale = self.format.row_scales(n, k, device=device)
        layer.weight.weight_loader = loader
        self.perm_of: dict[Hashable, torch.Tensor | None] = {}
        self._scale_rows: int | None = None  # scale_rows, once the weights are in

    # -- loading ---------------------------------------------------------------------------------------------

    def load(self, layer: KernelLinear, loaded: Any, rows: slice, src_rows: tuple[int, int] | None,
             src_cols: tuple[int, int] | None, shard_id: Hashable) -> None:
        """Rows `rows` of the packed parameters from checkpoint rows `src_rows` (None: all) and columns `src_cols`
        (None: all) of `loaded`: a quantized checkpoint's weight (its stored form is copied) or a float tensor
        (quantized here: FP8 by the absolute maximum of each row's group, 4-bit by its minimum and maximum)."""
        shape = tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)
        r0, r1 = src_rows if src_rows is not None else (0, shape[0])
        c0, c1 = src_cols if src_cols is not None else (0, shape[1])
        if c1 - c0 != self.k:
            raise ValueError(f"checkpoint columns [{c0}, {c1}) do not fill the layer's {self.k} inputs")
        fmt = self.format
        if isinstance(loaded, fmt.stored):
            codes, scale, perm = fmt.read_stored(loaded, r0, r1, c0, c1)
            if fmt.per_byte > 1:
                self._check_perm(layer, perm, shard_id)
        elif not hasattr(loaded, "read_packed"):  # (rows sharing scales are found again: scale_rows)
            codes, scale = fmt.quantize(as_tensor(loaded[r0:r1, c0:c1]).float(), self.group, self.layout.block_rows,
                                        r0)
        else:
            raise ValueError(f"a {type(loaded).__name__} cannot load into a {self.layout.describe()} layer")
        layer.weight.data[rows].copy_(codes)
        row_scale = layer.weight_row_scale.data[rows] if layer.weight_row_scale is not None else None
        fmt.copy_scales(layer.weight_scale.data[rows], row_scale, scale)

    def _check_perm(self, layer: KernelLinear, perm: torch.Tensor | None, shard_id: Hashable) -> None:
        """Every part of a fused layer shares one input, so they must sort their columns alike."""
        if perm is not None and layer.input_perm is None:
            raise ValueError("the checkpoint's columns are in act order, but the layer was not built for it")
        self.perm_of[shard_id] = perm
        perms = list(self.perm_of.values())
        if any(not _same_perm(p, perms[0]) for p in perms[1:]):
            raise ValueError("the fused layer's parts (e.g. q, k and v) sort their input columns into groups "
                             "differently (act order), so they cannot share one packed input order; "
                             "SHARDSERVE_QUANTIZED_LAYERS=dequantized serves this checkpoint with the values it "
                             "encodes")
        if perm is not None:
            layer.input_perm.data.copy_(perm)

    # -- the product -----------------------------------------------------------------------------------------

    def matmul(self, layer: KernelLinear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.k)
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            x = x.index_select(1, perm)
        out = self._product(layer, x)
        return out.reshape(*shape[:-1], self.n)

    def normed(self, layer: KernelLinear, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
               eps: float, swiglu_out: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the product of RMSNorm(x + residual), x + residual) for one row in one launch, where start-up timing
        chose the norm-fused GEMV for this shape (never for act order: its input is gathered first); else None.
        With `swiglu_out`, silu(gate) * up of the product where the layer takes that form (swiglu_out), else None."""
        if not self.norm_fused or x.dim() != 2 or x.shape[0] != 1 or getattr(layer, "input_perm", None) is not None:
            return None
        if swiglu_out and not self.takes_swiglu_out(layer, x):
            return None
        return self.format.normed_gemv(self, layer, x, residual, norm_weight, eps, swiglu_out=swiglu_out)

    def swiglu_out(self, layer: KernelLinear, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of the one-row product of a [gate | up] layer in the GEMV's own launch (takes_swiglu_out),
        else None: the caller applies SwiGLU."""
        return self._gemv(layer, x, swiglu_out=True) if self.takes_swiglu_out(layer, x) else None

    def takes_swiglu_out(self, layer: KernelLinear, x: torch.Tensor) -> bool:
        """Whether x's product returns silu(gate) * up in the GEMV's launch: one row on a GPU, the weights of a
        [gate | up] projection (layer.makes_swiglu_output) in FP8 or in 4 bits by the split-K GEMV, whose chosen
        configuration takes an even number of rows a program, and no act-order permutation of its input. That
        form reads what the plain one reads, so it runs the plain one's configuration (SHARDSERVE_GEMV_SWIGLU_OUT=off:
        never)."""
        from shardserve.layers.cuda_gemv import swiglu_out_allowed

        config = self.format.swiglu_out_config(self, layer)
        return (config is not None and getattr(layer, "makes_swiglu_output", False)
                and getattr(layer, "input_perm", None) is None and x.is_cuda
                and x.dim() == 2 and x.shape[0] == 1 and self.n % 2 == 0 and config[0] % 2 == 0
                and swiglu_out_allowed())

    def preloads_rows(self, layer: KernelLinear) -> bool:
        """Whether the layer's single-row GEMV loads all its rows before the dependent-launch wait
        (cuda_gemv.rows_preloaded): FP8, a tiled form chosen among those that hold them (gemv_choice's candidates)."""
        return self.gemv_split is None and holds_rows_of(self, self.gemv_config, preload_sms(layer))

    def _gemv(self, layer: KernelLinear, x: torch.Tensor, swiglu_out: bool = False) -> torch.Tensor:
        """The one-row product by the chosen GEMV; `swiglu_out` only where takes_swiglu_out (FP8 or split-K)."""
        return self.format.gemv(self, layer, x, swiglu_out=swiglu_out)

    def _gemm(self, layer: KernelLinear, x: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
        return self.format.gemm(self, layer, x, config)

    def _dequantized_product(self, layer: KernelLinear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(layer, x.dtype))

    def _product(self, layer: KernelLinear, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[0] == 1:
            return self._gemv(layer, x)
        if self.rowwise_fp8(x):
            return scaled_mm_rowwise(x, layer.weight, layer.weight_scale)
        config = self.batch_gemm(x)
        if config is not None:
            return self._gemm(layer, x, config)
        return self._dequantized_product(layer, x)

    def rowwise_fp8(self, x: torch.Tensor) -> bool:
        """Whether a batch x takes torch._scaled_mm (16-bit activations on a layer that can)."""
        return self.scaled_mm and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)

    def takes_gemm(self) -> bool:
        """Whether batches may run the fused GEMM: 16-bit activations, and not FP8 that torch._scaled_mm takes."""
        return self.compute_dtype in (torch.bfloat16, torch.float16) and not self.scaled_mm

    def batch_gemm(self, x: torch.Tensor) -> tuple[int, ...] | None:
        """The GEMM tiles chosen for x's bucket of row counts, or None: dequantize + cuBLAS."""
        if x.dtype not in (torch.bfloat16, torch.float16):
            return None
        return self.batch_gemms[batch_bucket(x.shape[0])]

    def config_key(self, layer: KernelLinear) -> str:
        """This layer's shape and layout, as the plain-data key its single-row configuration and batch kernels are
        agreed under; with the rows that share scales (scale_rows) where they are several."""
        rows = self.scale_rows(layer)
        return f"{self.layout.kind}/{self.group}/{self.n}/{self.k}" + (f"/rows{rows}" if rows > 1 else "")

    def scale_rows(self, layer: KernelLinear) -> int:
        """FP8 in groups: how many aligned rows share their scales (quant_gemv.rows_share_scales, up to 32; a
        block-scaled checkpoint's rows where this rank's start on a block's boundary), which the float16 sums of
        groups need; 1 for other layouts. Found once the weights are in, and kept (a reload brings the same)."""
        if self._scale_rows is None:
            self._scale_rows = self.format.scale_rows(layer.weight.data, layer.weight_scale.data, self.k, self.group)
        return self._scale_rows

    def dequantized(self, layer: KernelLinear, dtype: torch.dtype) -> torch.Tensor:
        """The layer's [N, K] weight in `dtype`, columns in the packed order (input_perm's)."""
        return self.format.dequantize(layer.weight, layer.weight_scale, self.group, dtype, row_scale(layer))

    def unpack(self, layer: KernelLinear) -> None:
        """Replace the packed parameters by the values they encode in the compute dtype (a dense layer again)."""
        weight = self.dequantized(layer, self.compute_dtype)
        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            dense = torch.empty_like(weight)
            dense[:, perm] = weight
            weight = dense
        loader = layer.weight.weight_loader
        for name in PACKED_PARTS:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight.weight_loader = loader
        layer.packed = None


def row_scale(layer: KernelLinear, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor | None:
    """The packed layer's scales a row (those of `rows`), where its format has them; else None."""
    row_scales = getattr(layer, "weight_row_scale", None)
    return None if row_scales is None else row_scales[rows]


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def scaled_mm_rowwise(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight * weight_scale)^T with x quantized to FP8 per row (its absolute maximum to FP8's
    largest value) and FP8 tensor cores; float32 accumulation, output in x's dtype."""
    from shardserve.kernels.triton.quant_gemv import quantize_rows_fp8

    x_fp8, x_scale = quantize_rows_fp8(x if x.stride(1) == 1 else x.contiguous(), FP8_MAX)
    # Fast accumulation (Hopper's FP8 tensor cores promote partial sums less often): about 2^-9 relative, well
    # under the 2^-4 of the activations' own rounding; the start-up check runs this same path.
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
                            out_dtype=x.dtype, use_fast_accum=True)


def holds_rows_of(packed: PackedWeights, config: tuple[int, ...], sms: int) -> bool:
    """Whether the FP8 GEMV in tiled `config` (its first tile loaded before the wait) holds all of the packed rows
    on a GPU of `sms` SMs (cuda_gemv.holds_rows; 0 SMs: never)."""
    from shardserve.layers.cuda_gemv import holds_rows

    return packed.layout.kind == "fp8" and holds_rows(packed.n, packed.k, 1, config[0], config[1], config[2], sms)


def preload_sms(layer: KernelLinear) -> int:
    """The SMs of the GPU whose programs may hold the layer's rows before the wait (FP8 weights of a layer flagged
    preloads_rows, with attention overlap on: kernels/triton/pdl.py), else 0."""
    from shardserve.kernels.triton import pdl
    from shardserve.kernels.triton.gemv import preload_tiles
    from shardserve.layers.cuda_gemv import sm_count

    # The FP8 GEMV loads its first tile before the wait unless SHARDSERVE_GEMV_PRELOAD=0.
    if not (layer.preloads_rows and layer.packed.layout.kind == "fp8" and layer.weight.is_cuda
            and pdl.attention_overlap() and preload_tiles() > 0):
        return 0
    return sm_count(layer.weight.device)
