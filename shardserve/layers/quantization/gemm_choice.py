"""Which kernel batches of a packed layer run: the fused GEMM (kernels/triton/quant_gemm.py) or the weight
dequantized to the compute dtype and cuBLAS, per bucket of row counts (packed.BATCH_LIMITS).

Chosen at start-up on CUDA, for every distinct packed shape that can take the GEMM (PackedWeights.takes_gemm):
in each bucket, every candidate tile is first checked against float64 at the bucket's timing row count, then
timed in a CUDA graph against dequantize + cuBLAS on the model's own layers of that shape. The GEMM is chosen
only where it was faster, so no batch runs slower than it would dequantizing. Choices are plain data
({'kind/group/N/K': per bucket [block_m, block_n, block_k, num_warps, num_stages] or None}) so that rank 0's
can be used on every rank; applied, they are checked once more (check_packed at gemm_check_rows) on every rank.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.linear import KernelLinear
from shardserve.layers.quantization.check import distinct_packed, sampled_reference
from shardserve.layers.quantization.packed import BATCH_BUCKETS
from shardserve.layers.quantization.selection import packed_layers

logger = logging.getLogger(__name__)

# Per bucket: the batch its tiles are timed at (the bucket's largest, and for the open-ended last bucket a long
# prefill chunk), and the ragged one its chosen GEMM is checked at once the ranks agree.
TIMING_ROWS = (16, 64, 256, 512, 1024, 4096)
CHECK_ROWS = (5, 40, 200, 400, 600, 1500)
# Batches up to this many rows stream the weights: timed over up to 32 layers so that the weights do not sit in
# L2 (as the GEMVs are); larger ones are bound by arithmetic, and a few layers keep start-up short.
STREAMING_ROWS = 256


@torch.inference_mode()
def time_batch_kernels(model: nn.Module) -> dict[str, list[list[int] | None]]:
    """Per distinct packed shape on CUDA that can take the GEMM, each bucket's fastest of the GEMM's candidate
    tiles (matching float64) and dequantize + cuBLAS: the tiles as a list, or None where dequantizing won."""
    chosen: dict[str, list[list[int] | None]] = {}
    for (layout, n, k, _), layers in distinct_packed(model).items():
        first = layers[0]
        if not (first.weight.is_cuda and first.packed.takes_gemm()):
            continue
        weight64, outputs = sampled_reference(first)
        results = []
        for rows in TIMING_ROWS:
            try:
                results.append(_fastest(layers, rows, weight64, outputs))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: that bucket keeps dequantizing
                logger.warning("packed %s %dx%d: timing batches of %d rows failed, so they dequantize: %s: %s",
                               layout.describe(), n, k, rows, type(e).__name__, e)
                results.append((None, float("nan"), float("nan")))
        chosen[first.packed.config_key(first)] = [config for config, _, _ in results]
        logger.info("packed %s %dx%d batches: %s", layout.describe(), n, k, "; ".join(
            f"{rows} rows: {_describe(*result)}" for rows, result in zip(TIMING_ROWS, results)))
        del weight64
    if chosen:
        torch.cuda.empty_cache()  # the timing graphs' memory, back before the KV cache is sized
    return chosen


def _fastest(layers: list[KernelLinear], rows: int, weight64: torch.Tensor,
             outputs: slice | torch.Tensor) -> tuple[list[int] | None, float, float]:
    """(the fastest GEMM tiles at `rows` rows that beat dequantize + cuBLAS, or None; its time; the dequantizing
    path's time), in microseconds a layer. weight64: the float64 weight of the compared outputs."""
    from shardserve.kernels.self_check import TOLERANCE, relative_error
    from shardserve.kernels.triton.quant_gemm import candidate_configs
    from shardserve.layers.cuda_gemv import time_in_graph_us

    first = layers[0]
    packed = first.packed
    timed = layers[:32] if rows <= STREAMING_ROWS else layers[:4]
    x = torch.randn(rows, packed.k, dtype=packed.compute_dtype, device=first.weight.device)
    dense_us = time_in_graph_us(lambda x, layer: layer.packed._dequantized_product(layer, x), timed, x)
    reference = F.linear(x.double(), weight64).cpu()
    best: tuple[list[int] | None, float] = (None, dense_us)
    for config in candidate_configs(rows):
        try:
            if relative_error(packed._gemm(first, x, config)[:, outputs], reference) > TOLERANCE[x.dtype]:
                logger.debug("GEMM tiles %s on %s at %d rows: wrong against float64", config, packed.config_key(first),
                             rows)
                continue
            us = time_in_graph_us(lambda x, layer, c=config: layer.packed._gemm(layer, x, c), timed, x)
        except Exception as e:  # noqa: BLE001 - tiles this shape or GPU cannot take
            logger.debug("GEMM tiles %s on %s at %d rows: %s", config, packed.config_key(first), rows, e)
            continue
        if us < best[1]:
            best = (list(config), us)
    return best[0], best[1], dense_us


def _describe(config: list[int] | None, us: float, dense_us: float) -> str:
    if config is None:
        return f"dequantize + cuBLAS {dense_us:.1f} us" if dense_us == dense_us else "dequantize + cuBLAS (not timed)"
    block_m, block_n, block_k, warps, stages = config
    return (f"GEMM {block_m}x{block_n}x{block_k} ({warps} warps, {stages} stages) {us:.1f} us, dequantize + cuBLAS "
            f"{dense_us:.1f} us")


def use_batch_kernels(model: nn.Module, chosen: dict[str, list[list[int] | None]]) -> None:
    """Give every packed layer the choice made for its shape ({}: dequantize + cuBLAS everywhere)."""
    for _, layer in packed_layers(model):
        configs = chosen.get(layer.packed.config_key(layer), [None] * BATCH_BUCKETS)
        if len(configs) != BATCH_BUCKETS:
            raise ValueError(f"batch kernels for {layer.packed.config_key(layer)} name {len(configs)} buckets, not "
                             f"{BATCH_BUCKETS}: every rank must run the same version")
        layer.packed.batch_gemms = tuple(None if c is None else tuple(c) for c in configs)


def gemm_check_rows(model: nn.Module) -> tuple[int, ...]:
    """The row counts that check every bucket some packed layer runs the GEMM in (none: nothing to check)."""
    used = {bucket for _, layer in packed_layers(model)
            for bucket, config in enumerate(layer.packed.batch_gemms) if config is not None}
    return tuple(CHECK_ROWS[bucket] for bucket in sorted(used))


def summary(model: nn.Module) -> str:
    """What the kernel plan records: in how many (shape, bucket) pairs of the shapes that can take the GEMM
    batches run it ("" where none can)."""
    shapes = {layer.packed.config_key(layer): layer.packed.batch_gemms for _, layer in packed_layers(model)
              if layer.packed.takes_gemm()}
    if not shapes:
        return ""
    gemm = sum(config is not None for configs in shapes.values() for config in configs)
    return f"batches through the fused GEMM in {gemm} of {len(shapes) * BATCH_BUCKETS} (shape, rows) buckets"
