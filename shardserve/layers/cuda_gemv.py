"""Single-token linear layers on GPUs: the Triton GEMV where it measured faster than cuBLAS, per shape.

A batch-1 decode step is bound by how fast it streams the weights. cuBLAS reaches that bandwidth on
large matrices but not on the attention projections of 8B-class models (it splits K and adds a second
kernel); the Triton kernel of shardserve/kernels/triton/gemv.py does each product in one launch. Which
is faster depends on the shape and the GPU, so at start-up every distinct weight shape is timed with
both (inside a CUDA graph, over the model's own layers so nothing comes from L2) and the winner is kept.
Batches of more than one row always use cuBLAS. SHARDSERVE_GEMV=cublas turns the Triton path off.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.linear_kernels import LinearKernel

logger = logging.getLogger(__name__)

# (block_n, block_k, num_warps, num_stages): the three that won some Llama-3-8B shape on H200, out of a grid
# of 24 (benchmarks/gemv_shapes.py).
CANDIDATES = ((8, 512, 4, 1), (4, 1024, 8, 4), (8, 512, 8, 4))
MIN_GAIN = 0.03  # keep cuBLAS unless Triton is at least this much faster


class Batch1GemvKernel(LinearKernel):
    """F.linear, except one-row inputs on weights whose shape has a chosen Triton configuration."""

    name = "cuda-gemv"

    def __init__(self, configs: dict[tuple[int, int], tuple[int, int, int, int]]) -> None:
        self.configs = configs

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:
            config = self.configs.get(tuple(weight.shape))
            if config is not None:
                from shardserve.kernels.triton.gemv import gemv

                out = gemv(x, weight, *config)
                return out if bias is None else out + bias
        return F.linear(x, weight, bias)


def _time_us(fn, weights: list[torch.Tensor], x: torch.Tensor, replays: int = 10) -> float:
    """Microseconds per call of fn(x, w) over `weights`, replayed from a CUDA graph."""
    for w in weights:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(weights))


@torch.inference_mode()
def use_batch1_gemv(model: nn.Module, log: bool = True) -> Batch1GemvKernel | None:
    """Time cuBLAS against the Triton candidates for each 16-bit weight shape of the model's linear layers;
    give every linear layer a kernel that uses the winners. Returns it, or None where nothing won."""
    if os.environ.get("SHARDSERVE_GEMV", "auto") == "cublas":
        return None
    from shardserve.kernels.triton.gemv import gemv

    layers = [m for m in model.modules() if hasattr(m, "matmul") and getattr(m, "prepared", None) is None]
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    for layer in layers:
        w = layer.weight
        if w.dim() == 2 and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and w.stride(1) == 1:
            by_shape.setdefault(tuple(w.shape), []).append(w.data)
    configs, report = {}, []
    for shape, weights in by_shape.items():
        weights = weights[:32]
        x = torch.randn(1, shape[1], dtype=weights[0].dtype, device=weights[0].device)
        cublas = _time_us(F.linear, weights, x)
        timed = [(_time_us(lambda x, w, c=c: gemv(x, w, *c), weights, x), c) for c in CANDIDATES]
        best_us, best = min(timed)
        if best_us < cublas * (1 - MIN_GAIN):
            configs[shape] = best
        report.append(f"{shape[0]}x{shape[1]} {'triton' if shape in configs else 'cuBLAS'} "
                      f"({best_us:.1f} vs {cublas:.1f} us)")
    if log and report:
        logger.info("batch-1 linear layers: %s", ", ".join(report))
    if not configs:
        return None
    kernel = Batch1GemvKernel(configs)
    for layer in layers:
        layer.kernel = kernel
    return kernel
