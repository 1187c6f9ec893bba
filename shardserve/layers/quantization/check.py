"""Every distinct packed shape against float64 at start-up, on the paths a step runs it (check_packed)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.linear import KernelLinear
from shardserve.layers.quantization.packed import row_scale
from shardserve.layers.quantization.selection import packed_layers

logger = logging.getLogger(__name__)

# FP8 batches quantize their activations to FP8 as well: each input then carries up to 2^-4 relative rounding,
# about 2e-2 over a dot product. A wrong layout or a scale applied to the wrong group is off by far more.
FP8_ACTIVATION_TOLERANCE = 6e-2


def reference_weight(layer: KernelLinear, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
    """float64 [N, K] (or those `rows`) from the packed bytes, written from the layouts' definitions (not the
    dequantizers)."""
    packed = layer.packed
    return packed.format.reference64(layer.weight[rows], layer.weight_scale[rows], packed.group,
                                     row_scale(layer, rows))


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
            error, detail = normed_error(layer, w64, outputs, generator)
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


def normed_error(layer: KernelLinear, w64: torch.Tensor, outputs, generator: torch.Generator) -> tuple[float, str]:
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
