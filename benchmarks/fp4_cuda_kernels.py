"""The CUDA C fp4 kernels (kernels/cuda/fp4_products.cu) against the Triton ones they stand beside, at
Nemotron-3-Nano-30B-A3B's NVFP4 shapes on one GPU: the GEMV of the Mamba-2 in_proj (10304 x 2688), out_proj
(2688 x 4096) and the attention's q|k|v (4608 x 2688), and one token's experts with the shared expert's two slots.

    python3 benchmarks/fp4_cuda_kernels.py [--shapes 10304x2688,...] [--gemv-configs 1x8,2x4] [--expert-tiles 2x8x4x3]
        [--skip-gemv] [--out FILE]

GEMVs: every (rows a warp x warps a block) configuration asked for, and the best of start-up's split-K forms, each
timed in a CUDA graph over 8 copies of the weight (more than the L2 holds) by cuda_gemv.time_in_graph_us, with its
relative error against float64. Experts: each tiles (up rows a warp x up warps x down warps x choices in flight)
against the Triton kernels at their default tiles, timed by moe_kernels.graph_time_us over four layers' experts
(more than the L2 holds); then the up launch alone.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.result_file import report  # noqa: E402

GEMV_SHAPES = "10304x2688,2688x4096,4608x2688"


def parse_tuples(value: str, length: int, flag: str) -> list[tuple[int, ...]]:
    """'1x8,2x4' -> [(1, 8), (2, 4)], each of `length` positive numbers; else SystemExit naming the flag."""
    try:
        items = [tuple(int(v) for v in part.split("x")) for part in value.split(",") if part]
    except ValueError:
        items = []
    if not items or any(len(t) != length or min(t) < 1 for t in items):
        raise SystemExit(f"{flag} takes comma-separated groups of {length} positive numbers joined by 'x', "
                         f"got {value!r}")
    return items


def gemv_rows(shape: tuple[int, int], configs: list[tuple[int, ...]]) -> dict:
    import torch

    from benchmarks.fp4_split_sweep import GROUP, time_config, weights
    from shardserve.kernels.cuda.fp4_products import fp4_gemv
    from shardserve.kernels.quant_pack import reference_weight64
    from shardserve.layers.cuda_gemv import time_in_graph_us
    from shardserve.layers.quantization.int4 import split_forms

    n, k = shape
    copies = weights(n, k, 8)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = copies[0][0].numel() + copies[0][1].numel() + 4 * n
    want = x.double() @ reference_weight64("fp4", *copies[0][:2], GROUP, copies[0][2]).T
    row = {}
    split = [(time_config(tuple(f), copies, x), tuple(f)) for f in split_forms(k, GROUP) if len(f) == 5]
    us, form = min(split)
    row["triton split-K"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3), "config": form}
    for config in configs:
        got = fp4_gemv(x, *copies[0], *config)
        us = time_in_graph_us(lambda x, c: fp4_gemv(x, *c, *config), copies, x, replays=20)
        row[f"cuda {config}"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3),
                                 "error": float((got.double() - want).norm() / want.norm())}
    return row


LAYERS = 4  # expert sets a timed graph walks through, so that replays stream from memory, not L2


def experts_rows(tiles: list[tuple[int, ...]]) -> dict:
    from benchmarks.moe_four_bit_one_token import experts_bytes, one_token_experts
    from benchmarks.moe_kernels import graph_time_us
    from shardserve.kernels.cuda import runtime
    from shardserve.kernels.cuda.fp4_products import fp4_experts
    from shardserve.kernels.triton.moe_four_bit import FOUR_BIT_PAIR_TILES, one_token_four_bit_experts

    layers = [one_token_experts("nemotron3-nano-30b-a3b", "fp4", 16, 2) for _ in range(LAYERS)]
    read = experts_bytes("nemotron3-nano-30b-a3b", "fp4", 16, 2)
    row = {"bytes": read, "layers a graph": LAYERS}

    def walk(fn):
        def run():
            for x, experts, weights, ids, shared in layers:
                fn(x, experts, weights, ids, shared)
        return run

    us = graph_time_us(walk(lambda x, e, w, i, s: one_token_four_bit_experts(x, e, w, i, FOUR_BIT_PAIR_TILES, s)),
                       50, 5) / LAYERS
    row["triton"] = {"us": round(us, 2), "GBps": round(read / us / 1e3)}
    launch = runtime.Kernel.launch
    for t in tiles:
        fn = walk(lambda x, e, w, i, s: fp4_experts(x, e, w, i, s, t, x_early=True))  # as NemotronH's block runs them
        us = graph_time_us(fn, 50, 5) / LAYERS
        try:  # the up launch alone: the down launch skipped
            runtime.Kernel.launch = lambda self, *a, **kw: None if "down" in self.name else launch(self, *a, **kw)
            up = graph_time_us(fn, 50, 5) / LAYERS
        finally:
            runtime.Kernel.launch = launch
        row[f"cuda {t}"] = {"us": round(us, 2), "GBps": round(read / us / 1e3), "up_us": round(up, 2)}
        print(t, row[f"cuda {t}"], flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=GEMV_SHAPES)
    p.add_argument("--gemv-configs", default="1x4,1x8,2x4,2x8,4x4")
    p.add_argument("--expert-tiles", default="2x8x4x3,2x8x4x2,2x8x8x3,2x8x2x3")
    p.add_argument("--skip-gemv", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    shapes = parse_tuples(args.shapes, 2, "--shapes")
    configs = parse_tuples(args.gemv_configs, 2, "--gemv-configs")
    tiles = parse_tuples(args.expert_tiles, 4, "--expert-tiles")
    import torch

    results = {"device": torch.cuda.get_device_name()}
    for shape in [] if args.skip_gemv else shapes:
        results[f"{shape[0]}x{shape[1]}"] = gemv_rows(shape, configs)
        print(shape, results[f"{shape[0]}x{shape[1]}"], flush=True)
    results["experts"] = experts_rows(tiles)
    report(results, args.out)


if __name__ == "__main__":
    main()
