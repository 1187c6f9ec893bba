"""Linear layers that keep quantized weights packed: FP8 (a byte a weight) and 4-bit (half a byte).

A packed layer's parameters, on this rank, are `weight` (the codes) and `weight_scale`, and for act-order 4-bit
checkpoints `input_perm`; what they hold, how they load and which kernels compute with them is each format's file in
layers/quantization/ (fp8.py, int4.py, fp4.py). This module is what every format shares: the packed layer
(PackedWeights), which layers are packed, the choice of kernels at start-up and the check against float64.

Rows of a fused layer (q/k/v, gate/up) stack their parts' rows, each with its own scales, so sharding packed weights
is the dense rule: column-parallel layers own rows, row-parallel layers own columns, and a rank's columns must be
whole scale groups. A layer whose slice would split a group is not packed: it keeps the values it encodes in the
compute dtype (logged by name), exactly as on CPUs. A GPTQ checkpoint's quantized LM head (`lm_head: true`) is packed
too, by vocabulary rows like a column-parallel layer (layers/embedding.py).

Products: a single row runs the Triton GEMVs of kernels/triton/quant_gemv.py; batches run torch._scaled_mm on FP8
with one scale a row and dynamic per-token activation scales (Hopper and Ada), else, per bucket of row counts
(BATCH_LIMITS), the Triton GEMM of kernels/triton/quant_gemm.py that reads the packed weights (16-bit activations,
only where start-up timing chose it: layers/packed_batches.py) or the weight dequantized to the compute dtype and
cuBLAS. Every distinct packed shape is checked against float64 at start-up on the paths it runs (`check_packed`);
a failure unpacks every packed layer (WARNING), so no rank serves a wrong product.
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
from shardserve.layers.embedding import ParallelLMHead
from shardserve.layers.quantization import format_of
# The formats' candidates and quantizers, also named here (start-up's timing and the benchmarks walk them).
from shardserve.layers.quantization.base import DEFAULT_GEMV, GEMV_CANDIDATES  # noqa: F401
from shardserve.layers.quantization.fp4 import quantize_fp4
from shardserve.layers.quantization.fp8 import FP8_F16_CANDIDATES, FP8_MAX, FP8_SUMS_ENV, quantize_fp8  # noqa: F401
from shardserve.layers.quantization.int4 import INT4_SPLIT_CANDIDATES, INT4_SUMS_ENV, quantize_int4  # noqa: F401
from shardserve.layers.linear import ColumnParallelLinear, KernelLinear, RowParallelLinear, as_tensor
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
PACKED_PARTS = ("weight_scale", "input_perm")
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
        # 4-bit only: the split-K GEMV's configuration (INT4_SPLIT_CANDIDATES) where start-up timing found it
        # faster than every tiled one; None runs the tiled GEMV (gemv_config).
        self.gemv_split: tuple[int, ...] | None = None
        # One-row products of a normed input (the QKV and gate/up projections) with the norm inside the GEMV:
        # set by start-up timing where that measured faster than the norm kernel and the GEMV.
        self.norm_fused = False
        # Per batch bucket, the fused GEMM's (block_m, block_n, block_k, num_warps, num_stages), or None for
        # dequantize + cuBLAS: None until start-up timing picks (packed_batches.py), and always on CPUs.
        self.batch_gemms: tuple[tuple[int, ...] | None, ...] = (None,) * BATCH_BUCKETS
        device = torch.device(device)
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
        _copy_scales(layer.weight_scale.data[rows], scale)

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
        (cuda_gemv.rows_preloaded): FP8, a tiled form chosen among those that hold them (_candidate_forms)."""
        return self.gemv_split is None and holds_rows_of(self, self.gemv_config, _preload_sms(layer))

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
        return self.format.dequantize(layer.weight, layer.weight_scale, self.group, dtype)

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


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def _copy_scales(target: torch.Tensor, scale: torch.Tensor) -> None:
    if tuple(scale.shape) != tuple(target.shape):
        raise ValueError(f"scales of shape {tuple(scale.shape)} where the layer holds {tuple(target.shape)}")
    target.copy_(scale)


# How a float tensor loading into a packed layer of each kind is quantized (each format's quantize).
QUANTIZERS = {"fp8": quantize_fp8, "int4": quantize_int4, "fp4": quantize_fp4}


def scaled_mm_rowwise(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight * weight_scale)^T with x quantized to FP8 per row (its absolute maximum to FP8's
    largest value) and FP8 tensor cores; float32 accumulation, output in x's dtype."""
    from shardserve.kernels.triton.quant_gemv import quantize_rows_fp8

    x_fp8, x_scale = quantize_rows_fp8(x if x.stride(1) == 1 else x.contiguous(), FP8_MAX)
    # Fast accumulation (Hopper's FP8 tensor cores promote partial sums less often): about 2^-9 relative, well
    # under the 2^-4 of the activations' own rounding; the start-up check runs this same path.
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
                            out_dtype=x.dtype, use_fast_accum=True)


# -- which layers are packed -------------------------------------------------------------------------------


def packed_layers(model: nn.Module) -> list[tuple[str, KernelLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, KernelLinear) and m.packed is not None]


def is_router(name: str) -> bool:
    """Routers and shared-expert gates stay in the compute dtype (checkpoints keep them so: a few rows that
    decide which experts run)."""
    last = name.rsplit(".", 1)[-1]
    return last in ("gate", "shared_expert_gate")


def quantizable_layers(model: nn.Module, head: bool = False) -> list[tuple[str, KernelLinear]]:
    """The column- and row-parallel layers a packed format applies to: every one but the routers and those that keep a
    dense weight (`keeps_dense_weight`: DeepSeek's kv_b_proj, read as W_UK and W_UV); with `head`, the untied LM head
    as well (vocabulary-parallel: a column-parallel layer over the vocabulary)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and not is_router(name)
            and not getattr(m, "keeps_dense_weight", False)
            or head and isinstance(m, ParallelLMHead) and not m.tied]


def layout_for(layer: KernelLinear, layout: PackedLayout) -> tuple[PackedLayout | None, str]:
    """The layout this rank's slice of `layer` takes (the group in local columns), or None and why it cannot be
    packed: a row-parallel slice that starts or ends inside a scale group, or of an act-order layer at more
    than one rank (its groups are spread over all columns)."""
    k = layer.weight.shape[1]
    if layout.group and k % layout.group:
        return None, f"its {k} input columns are not whole groups of {layout.group}"
    if format_of(layout.kind).per_byte > 1 and k % 2:
        return None, f"its {k} input columns do not pack in pairs"
    if not isinstance(layer, RowParallelLinear) or layer.comm is None:
        return layout, ""
    c0, c1 = layer.cols
    if layout.act_order:
        return None, "an act-order layer split by input columns"
    if layout.group and (c0 % layout.group or (c1 - c0) % layout.group):
        return None, f"its columns [{c0}, {c1}) split groups of {layout.group}"
    return layout, ""


def pack_layers(model: nn.Module, names: set[str] | None, layout: PackedLayout, device: torch.device | str,
                log: bool = True, head: bool = False) -> int:
    """Make the quantizable layers (those in `names`, the LM head among them where named; None: all, the head only
    with `head`) packed before loading; the others get their dense weights (layers built under deferred_weights()).
    Returns how many were packed."""
    chosen = {name for name, _ in quantizable_layers(model, head=head or names is not None)
              if names is None or name in names}
    count, unpacked = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, KernelLinear):
            continue
        local = None
        if name in chosen:
            local, why = layout_for(module, layout)
            if local is None:
                unpacked.append(f"{name} ({why})")
        if local is not None:
            module.packed = PackedWeights(module, local, device)
            count += 1
        else:
            module.materialize(device)
    if log:
        log_kept_dequantized("layers keep dequantized weights", unpacked, layout)
    return count


def log_kept_dequantized(what: str, unpacked: list[str], layout: PackedLayout) -> None:
    """One line naming the first few of the modules (with why) that could not stay packed in `layout`."""
    if unpacked:
        logger.info("%d %s rather than %s: %s", len(unpacked), what, layout.describe(),
                    "; ".join(unpacked[:4]) + (" ..." if len(unpacked) > 4 else ""))


def unpack_all(model: nn.Module) -> int:
    layers = packed_layers(model)
    for _, layer in layers:
        layer.packed.unpack(layer)
    return len(layers)


# -- start-up: check, then time the single-row kernels ---------------------------------------------------------

# FP8 batches quantize their activations to FP8 as well: each input then carries up to 2^-4 relative rounding,
# about 2e-2 over a dot product. A wrong layout or a scale applied to the wrong group is off by far more.
FP8_ACTIVATION_TOLERANCE = 6e-2


def reference_weight(layer: KernelLinear, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
    """float64 [N, K] (or those `rows`) from the packed bytes, written from the layouts' definitions (not the
    dequantizers)."""
    packed = layer.packed
    return packed.format.reference64(layer.weight[rows], layer.weight_scale[rows], packed.group)


def distinct_packed(model: nn.Module) -> dict[tuple, list[KernelLinear]]:
    """Packed layers grouped by (layout, N, K, rows sharing scales): what the kernels must be right on, and timed
    over (PackedWeights.config_key's groups)."""
    found: dict[tuple, list[KernelLinear]] = {}
    for _, layer in packed_layers(model):
        p = layer.packed
        found.setdefault((p.layout, p.n, p.k, p.scale_rows(layer)), []).append(layer)
    return found


def sampled_reference(layer: KernelLinear, weight64: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, slice | torch.Tensor]:
    """(float64 weight of the outputs a check compares, which outputs): all of them up to the self-check's
    sample (kernels/self_check.sampled_outputs). `weight64`: the layer's reference_weight where already made; else
    only the sampled rows are made (a 4-bit LM head's whole reference is 4.2 GB at 128,256 x 4,096)."""
    from shardserve.kernels.self_check import sampled_outputs

    sampled = sampled_outputs(layer.packed.n)
    outputs = slice(None) if sampled is None else sampled.to(layer.weight.device)
    return (reference_weight(layer, outputs) if weight64 is None else weight64[outputs]), outputs


@torch.inference_mode()
def check_packed(model: nn.Module, rows=(1, 5), seed: int = 0) -> list[str]:
    """Each distinct packed shape's product at one row (the GEMV) and a batch, against float64 on the same
    packed values, through the path each row count takes now (once batch kernels are chosen, again at a row count
    in each bucket that runs the GEMM); returns what failed, as 'fp8 (...) NxK at R rows: error E (tolerance T)'."""
    from shardserve.kernels.self_check import TOLERANCE, relative_error

    failures = []
    for (layout, n, k, _), layers in distinct_packed(model).items():
        layer = layers[0]
        dtype = layer.packed.compute_dtype
        swiglu_layer = next((m for m in layers if getattr(m, "makes_swiglu_output", False)), None)
        # Whole for SwiGLU out's gate and up rows, else only the sampled rows the products are compared on.
        weight64 = reference_weight(layer) if swiglu_layer is layer else None
        w64, outputs = sampled_reference(layer, weight64)
        generator = torch.Generator().manual_seed(seed)
        for m in rows:
            x = torch.randn(m, k, generator=generator).to(dtype).to(layer.weight.device)
            tolerance = TOLERANCE.get(dtype, 1e-2)
            if m > 1 and layer.packed.rowwise_fp8(x):
                tolerance = max(tolerance, FP8_ACTIVATION_TOLERANCE)
            try:
                error = relative_error(layer.packed._product(layer, x)[:, outputs], F.linear(x.double(), w64).cpu())
                detail = f"error {error:.2g} (tolerance {tolerance:.2g})"
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape fails its check
                error, detail = float("inf"), f"{type(e).__name__}: {e}"
            if not error <= tolerance:
                failures.append(f"{layout.describe()} {n}x{k} at {m} rows: {detail}")
        if layer.packed.norm_fused:
            error, detail = _normed_error(layer, w64, outputs, generator)
            if not error <= TOLERANCE.get(dtype, 1e-2):
                failures.append(f"{layout.describe()} {n}x{k} with the norm before it: {detail}")
        if swiglu_layer is not None:
            error, detail = _swiglu_out_error(swiglu_layer, weight64, generator)
            if not error <= TOLERANCE.get(dtype, 1e-2):
                failures.append(f"{layout.describe()} {n}x{k} with SwiGLU out: {detail}")
        del weight64
    return failures


def _swiglu_out_error(layer: KernelLinear, weight64: torch.Tensor | None,
                      generator: torch.Generator) -> tuple[float, str]:
    """A [gate | up] layer's single-row product with SwiGLU inside (PackedWeights.swiglu_out; with the norm inside
    too where norm-fused) against float64 silu(gate) * up on the same packed values (`weight64`, its
    reference_weight where already made): (relative error, what to report); (0, ...) where the layer does not take
    that form."""
    from shardserve.kernels.self_check import relative_error
    from shardserve.layers.norm import RMSNorm

    packed, device = layer.packed, layer.weight.device
    dtype, k, half = packed.compute_dtype, packed.k, packed.n // 2
    x = torch.randn(1, k, generator=generator).mul_(3).to(dtype).to(device)
    if not packed.takes_swiglu_out(layer, x):
        return 0.0, "not taken"
    w64 = reference_weight(layer) if weight64 is None else weight64
    try:
        error = 0.0
        for norm_fused in (False, True) if packed.norm_fused else (False,):
            if norm_fused:
                norm = RMSNorm(k, 1e-5, dtype).to(device)
                h = norm(x.clone())
                out = packed.normed(layer, x, None, norm.weight, norm.eps, swiglu_out=True)[0]
            else:
                h, out = x, packed.swiglu_out(layer, x)
            product = F.linear(h.double(), w64)
            want = (F.silu(product[:, :half]) * product[:, half:]).cpu()
            error = max(error, relative_error(out, want))
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape fails its check
        return float("inf"), f"{type(e).__name__}: {e}"
    return error, f"error {error:.2g}"


def _normed_error(layer: KernelLinear, w64: torch.Tensor, outputs, generator: torch.Generator) -> tuple[float, str]:
    """The norm-fused single-row product (PackedWeights.normed) against float64 on the norm module's output, with
    a residual: (relative error, what to report)."""
    from shardserve.kernels.self_check import TOLERANCE, relative_error
    from shardserve.layers.norm import RMSNorm

    dtype, k = layer.packed.compute_dtype, layer.packed.k
    norm = RMSNorm(k, 1e-5, dtype).to(layer.weight.device)
    norm.weight.data.copy_(torch.rand(k, generator=generator).add_(0.5))
    x = torch.randn(1, k, generator=generator).mul_(3).to(dtype).to(layer.weight.device)
    residual = torch.randn(1, k, generator=generator).to(dtype).to(layer.weight.device)
    try:
        h, _ = norm(x.clone(), residual.clone())
        out = layer.packed.normed(layer, x, residual, norm.weight, norm.eps)
        error = relative_error(out[0][:, outputs], F.linear(h.double(), w64).cpu())
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape fails its check
        return float("inf"), f"{type(e).__name__}: {e}"
    return error, f"error {error:.2g} (tolerance {TOLERANCE.get(dtype, 1e-2):.2g})"


# A single-row form: the tiled GEMV's configuration (GEMV_CANDIDATES) and the split-K GEMV's (4-bit weights,
# INT4_SPLIT_CANDIDATES), or None to run the tiled one.
GemvForm = tuple[tuple[int, ...], tuple[int, ...] | None]


def _set_form(layers: list[KernelLinear], form: GemvForm, norm_fused: bool = False) -> None:
    for layer in layers:
        (layer.packed.gemv_config, layer.packed.gemv_split), layer.packed.norm_fused = form, norm_fused


def _candidate_forms(packed: PackedWeights, preload_sms: int = 0, scale_rows: int = 1) -> list[GemvForm]:
    """The single-row forms start-up times for a packed shape; with `preload_sms` (_preload_sms: FP8 layers flagged
    KernelLinear.preloads_rows, the GPU's SMs) only tiled ones whose first tile, loaded before the wait, is the whole
    row block and that hold it (cuda_gemv.holds_rows), where there are such. scale_rows: tiled_candidates'."""
    tiled = tiled_candidates(packed, scale_rows)
    holding = [(config, None) for config in tiled if holds_rows_of(packed, config, preload_sms)]
    if holding:
        return holding
    forms: list[GemvForm] = [(config, None) for config in tiled]
    forms += [(DEFAULT_GEMV, config) for config in int4_split_forms(packed)]
    return forms


def int4_split_forms(packed: PackedWeights) -> list[tuple[int, ...]]:
    """The split-K configurations start-up times for a packed shape (its format's split_forms)."""
    return packed.format.split_forms(packed)


def tiled_candidates(packed: PackedWeights, scale_rows: int = 1) -> tuple[tuple[int, ...], ...]:
    """The tiled GEMV configurations start-up times for a packed shape (its format's tiled_candidates; scale_rows:
    PackedWeights.scale_rows)."""
    return packed.format.tiled_candidates(packed, scale_rows)


def holds_rows_of(packed: PackedWeights, config: tuple[int, ...], sms: int) -> bool:
    """Whether the FP8 GEMV in tiled `config` (its first tile loaded before the wait) holds all of the packed rows
    on a GPU of `sms` SMs (cuda_gemv.holds_rows; 0 SMs: never)."""
    from shardserve.layers.cuda_gemv import holds_rows

    return packed.layout.kind == "fp8" and holds_rows(packed.n, packed.k, 1, config[0], config[1], config[2], sms)


def _preload_sms(layer: KernelLinear) -> int:
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


def _product_as_run(x: torch.Tensor, layer: KernelLinear) -> torch.Tensor:
    """A one-row product in the form a step runs it, for timing: with SwiGLU out where the layer takes it (the form
    can time several microseconds apart from the plain product on the same tiles; gate/up in FP8 on an H100: 40.3
    against 41.3 us in one configuration, with the norm inside 41.5 against 46.5 in another)."""
    packed = layer.packed
    return packed.swiglu_out(layer, x) if packed.takes_swiglu_out(layer, x) else packed._product(layer, x)


def _describe_form(form: GemvForm) -> str:
    config, split = form
    return f"tiled {config}" if split is None else f"split-K {split}"


@torch.inference_mode()
def time_gemv_configs(model: nn.Module) -> dict[str, list[int]]:
    """Per distinct packed shape on CUDA, the fastest single-row form that matches float64 (_candidate_forms),
    timed inside a CUDA graph over the model's own layers of that shape, each running the form as a step runs it
    (_product_as_run); for layers that take a normed input, also the norm inside the GEMV (_choose_normed). Keys
    (plain data, to agree on):
    'kind/group/N/K' the tiled configuration, that + SPLIT_SUFFIX the split-K one where it won, + NORM_FUSED_SUFFIX
    where the norm runs inside."""
    from shardserve.kernels.self_check import TOLERANCE, relative_error
    from shardserve.layers.cuda_gemv import time_in_graph_us

    chosen: dict[str, list[int]] = {}
    for (layout, n, k, _), layers in distinct_packed(model).items():
        first, timed_layers = layers[0], layers[:32]
        if not first.weight.is_cuda:
            continue
        dtype = first.packed.compute_dtype
        x = torch.randn(1, k, dtype=dtype, device=first.weight.device)
        w64, outputs = sampled_reference(first)
        reference = F.linear(x.double(), w64).cpu()
        timed: list[tuple[float, GemvForm]] = []
        for form in _candidate_forms(first.packed, _preload_sms(first), first.packed.scale_rows(first)):
            _set_form(timed_layers, form)
            try:
                error = relative_error(first.packed._product(first, x)[:, outputs], reference)
                if not error <= TOLERANCE.get(dtype, 1e-2):
                    continue
                us = time_in_graph_us(_product_as_run, timed_layers, x)
            except Exception as e:  # noqa: BLE001 - a configuration this shape cannot take
                logger.debug("GEMV %s on %s %dx%d: %s", _describe_form(form), layout.describe(), n, k, e)
                continue
            timed.append((us, form))
        _set_form(timed_layers, (DEFAULT_GEMV, None))
        if timed:
            us, best = min(timed, key=lambda t: t[0])
            logger.info("packed %s %dx%d single-row GEMV: %s, %.1f us (%.0f GB/s)", layout.describe(), n, k,
                        _describe_form(best), us,
                        sum(t.numel() * t.element_size() for t in (first.weight, first.weight_scale)) / us / 1e3)
            form, fused = _choose_normed(layers, timed, w64, outputs) or (best, False)
            key = first.packed.config_key(first)
            chosen[key] = list(form[0])
            if form[1] is not None:
                chosen[key + SPLIT_SUFFIX] = list(form[1])
            if fused:
                chosen[key + NORM_FUSED_SUFFIX] = [1]
        del w64
    return chosen


# A norm-fused single-row GEMV replaces the norm kernel and the plain GEMV: it is kept unless those two are faster
# by this share of its time (layers/cuda_gemv.py's rule for 16-bit weights).
NORM_APART_MIN_GAIN = 0.03
# The norm inside is timed in the plain GEMV's NORM_FUSED_CANDIDATES fastest forms of each kind: its ranking is
# not theirs (on an H200 FP8's 6144x4096 q/k/v: plain 8.4 us in (4, 2048, 8, 4) and 8.6 in (8, 1024, 8, 3), with
# the norm inside 11.1 and 10.0 us).
NORM_FUSED_CANDIDATES = 3
NORM_FUSED_SUFFIX = "/norm"
SPLIT_SUFFIX = "/split"


def _choose_normed(layers: list[KernelLinear], timed: list[tuple[float, GemvForm]],
                   w64: torch.Tensor, outputs: slice | torch.Tensor) -> tuple[GemvForm, bool] | None:
    """For layers of one packed shape that take a normed input (column-parallel, no input permutation): the
    fastest of each kind's NORM_FUSED_CANDIDATES fastest forms with the norm inside, where that checks against
    float64 (w64: their reference weight of the compared `outputs`, sampled_reference) and the fastest tiled or
    split-K form in `timed` (times of their plain GEMVs) after the norm kernel is not faster by NORM_APART_MIN_GAIN;
    else that form after the norm kernel.
    Returns (form, norm inside), or None for other layers."""
    first = layers[0]
    if not hasattr(first, "forward_normed") or getattr(first, "input_perm", None) is not None:
        return None
    from shardserve.kernels.self_check import TOLERANCE
    from shardserve.layers.cuda_gemv import time_in_graph_us
    from shardserve.layers.norm import RMSNorm

    dtype, k, device = first.packed.compute_dtype, first.packed.k, first.weight.device
    norm = RMSNorm(k, 1e-5, dtype).to(device)
    residual = torch.randn(1, k, dtype=dtype, device=device)
    x = torch.randn(1, k, dtype=dtype, device=device)
    timed_layers = layers[:32]
    by_kind: dict[bool, list[GemvForm]] = {}  # by whether the form is tiled, fastest first
    for _, form in sorted(timed, key=lambda t: t[0]):
        by_kind.setdefault(form[1] is None, []).append(form)
    apart: list[tuple[float, GemvForm]] = []
    fused: list[tuple[float, GemvForm]] = []
    fastest = [forms[0] for forms in by_kind.values()]  # timed after the norm kernel too
    candidates = [form for forms in by_kind.values() for form in forms[:NORM_FUSED_CANDIDATES]]
    try:
        for form in candidates:
            if form in fastest:
                _set_form(timed_layers, form)
                apart.append((time_in_graph_us(
                    lambda x, layer: _product_as_run(norm(x, residual)[0], layer), timed_layers, x), form))
            _set_form(timed_layers, form, norm_fused=True)
            error, detail = _normed_error(first, w64, outputs, torch.Generator().manual_seed(3))
            if not error <= TOLERANCE.get(dtype, 1e-2):
                logger.warning("packed %dx%d: the norm-fused %s failed its check (%s); not used", first.packed.n, k,
                               _describe_form(form), detail)
                continue
            fused.append((time_in_graph_us(lambda x, layer: layer.packed.normed(
                layer, x, residual, norm.weight, norm.eps, swiglu_out=layer.packed.takes_swiglu_out(layer, x)),
                timed_layers, x), form))
    except Exception as e:  # noqa: BLE001 - a form this shape cannot take
        logger.debug("norm-fused GEMV on %dx%d: %s", first.packed.n, k, e)
    finally:
        _set_form(timed_layers, (DEFAULT_GEMV, None))
    if not apart:
        return None
    best_apart = min(apart, key=lambda t: t[0])
    best_fused = min(fused, key=lambda t: t[0]) if fused else None
    inside = best_fused is not None and not best_apart[0] < best_fused[0] * (1 - NORM_APART_MIN_GAIN)
    us, form = best_fused if inside else best_apart
    logger.info("packed %dx%d with the norm before it: %s %s, %.1f us (after the norm kernel at best %.1f us%s)",
                first.packed.n, k, _describe_form(form), "with the norm inside" if inside else "after the norm kernel",
                us, best_apart[0], f", with it inside at best {best_fused[0]:.1f} us" if best_fused else "")
    return form, inside


def use_gemv_configs(model: nn.Module, chosen: dict[str, list[int]]) -> None:
    """Apply time_gemv_configs' choices (agreed by every rank); a shape not in `chosen` takes the default."""
    for _, layer in packed_layers(model):
        key = layer.packed.config_key(layer)
        split = chosen.get(key + SPLIT_SUFFIX)
        _set_form([layer], (tuple(chosen.get(key, DEFAULT_GEMV)), tuple(split) if split else None),
                  key + NORM_FUSED_SUFFIX in chosen)
