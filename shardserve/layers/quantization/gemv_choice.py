"""Start-up's choice of each packed shape's single-row kernel: the forms its format offers, each checked against
float64 and timed in a CUDA graph over the model's own layers, and the norm inside the GEMV where that is faster
(time_gemv_configs); every rank then takes rank 0's choice (use_gemv_configs)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.linear import KernelLinear
from shardserve.layers.quantization.base import DEFAULT_GEMV
from shardserve.layers.quantization.check import distinct_packed, normed_error, sampled_reference
from shardserve.layers.quantization.packed import PackedWeights, holds_rows_of, preload_sms
from shardserve.layers.quantization.selection import packed_layers

logger = logging.getLogger(__name__)

# A single-row form: (the tiled GEMV's configuration, the split-K GEMV's (int4.INT4_SPLIT_CANDIDATES) or fp4's CUDA
# GEMV's (fp4.is_cuda_form), or None to run the tiled one).
GemvForm = tuple[tuple[int, ...], tuple[int, ...] | None]


def _set_form(layers: list[KernelLinear], form: GemvForm, norm_fused: bool = False) -> None:
    for layer in layers:
        (layer.packed.gemv_config, layer.packed.gemv_split), layer.packed.norm_fused = form, norm_fused


def _candidate_forms(packed: PackedWeights, preload_sms: int = 0, scale_rows: int = 1) -> list[GemvForm]:
    """The single-row forms start-up times for a packed shape; with `preload_sms` (packed.preload_sms: FP8 layers
    flagged KernelLinear.preloads_rows, the GPU's SMs) only tiled ones whose first tile, loaded before the wait, is
    the whole row block and that hold it (cuda_gemv.holds_rows), where there are such. scale_rows: the
    format's tiled_candidates'."""
    tiled = packed.format.tiled_candidates(packed, scale_rows)
    holding = [(config, None) for config in tiled if holds_rows_of(packed, config, preload_sms)]
    if holding:
        return holding
    forms: list[GemvForm] = [(config, None) for config in tiled]
    forms += [(DEFAULT_GEMV, config) for config in packed.format.split_forms(packed)]
    return forms


def _product_as_run(x: torch.Tensor, layer: KernelLinear) -> torch.Tensor:
    """A one-row product in the form a step runs it, for timing: with SwiGLU out where the layer takes it (the form
    can time several microseconds apart from the plain product on the same tiles; gate/up in FP8 on an H100: 40.3
    against 41.3 us in one configuration, with the norm inside 41.5 against 46.5 in another)."""
    packed = layer.packed
    return packed.swiglu_out(layer, x) if packed.takes_swiglu_out(layer, x) else packed._product(layer, x)


def _packed_bytes(layer: KernelLinear) -> int:
    """The bytes a single-row product reads of a packed layer: its codes, group scales and (fp4) row scales."""
    parts = (getattr(layer, name, None) for name in ("weight", "weight_scale", "weight_row_scale"))
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _describe_form(form: GemvForm) -> str:
    from shardserve.layers.quantization.fp4 import is_cuda_form

    config, split = form
    if is_cuda_form(split):
        return f"CUDA {split}"
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
        for form in _candidate_forms(first.packed, preload_sms(first), first.packed.scale_rows(first)):
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
                        _packed_bytes(first) / us / 1e3)
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
            error, detail = normed_error(first, w64, outputs, torch.Generator().manual_seed(3))
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
