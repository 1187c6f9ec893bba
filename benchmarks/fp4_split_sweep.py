"""The split-K 4-bit GEMV on e2m1 codes (NVFP4's groups of 16) over a wider grid of launch shapes than start-up
times, at Nemotron-3-Nano-30B-A3B's projections on one GPU: the Mamba-2 in_proj (10304 x 2688), out_proj
(2688 x 4096) and the attention's q|k|v (4608 x 2688).

    python benchmarks/fp4_split_sweep.py [--shapes 10304x2688,2688x4096] [--copies 8]

Grid: rows a program (block_n) x columns a split (K's power-of-two splits, or the padded ones of
quant_gemv.int4_padded_splits) x warps x row tiles a program. Each configuration is timed in a CUDA graph over
`copies` copies of the weight (more than the L2 holds: every call streams from memory) by cuda_gemv.time_in_graph_us.
Prints one JSON line: per shape, the start-up candidates' best, the grid's five best (us and GB/s of codes and
scales) and how many configurations could not run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardserve.kernels.quant_pack import fp4_scale_bytes, pack_int4  # noqa: E402
from shardserve.kernels.triton.quant_gemv import int4_gemv_split, int4_padded_splits, int4_split_sub  # noqa: E402
from shardserve.layers.cuda_gemv import time_in_graph_us  # noqa: E402
from shardserve.layers.quantization.int4 import split_forms  # noqa: E402

GROUP = 16


def weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(n + k)
    codes = pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)).cuda()
    scales = fp4_scale_bytes((torch.rand(n, k // GROUP, generator=g) * 8).to(torch.float8_e4m3fn)).cuda()
    rows = torch.ones(n, device="cuda")
    return [(codes.clone(), scales.clone(), rows) for _ in range(copies)]


def grid(k: int) -> list[tuple[int, ...]]:
    splits = [s for s in (256, 512, 1024) if k % s == 0] or int4_padded_splits(k)
    configs = []
    for block_n, split_k, warps, row_tiles in itertools.product((32, 64, 128), splits, (4, 8), (1, 2)):
        if int4_split_sub(k, GROUP, split_k) is not None:
            configs.append((block_n, split_k, warps, row_tiles, 1))
    return configs


def time_config(config: tuple[int, ...], copies: list, x: torch.Tensor) -> float:
    def call(x, w):
        return int4_gemv_split(x, w[0], w[1], GROUP, *config, codes="fp4", row_scale=w[2])

    return time_in_graph_us(call, copies, x, replays=20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="10304x2688,2688x4096,4608x2688")
    p.add_argument("--copies", type=int, default=8)
    args = p.parse_args()
    results = {"device": torch.cuda.get_device_name()}
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        copies = weights(n, k, args.copies)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = copies[0][0].numel() + copies[0][1].numel() + 4 * n
        timed, failed = [], 0
        start_up = {tuple(f) for f in split_forms(k, GROUP) if len(f) == 5}
        for config in sorted(set(grid(k)) | start_up):
            try:
                timed.append((time_config(config, copies, x), config))
            except Exception:  # noqa: BLE001 - a shape the kernel refuses or cannot compile
                failed += 1
        timed.sort()
        best_start_up = min((t for t in timed if t[1] in start_up), default=None)

        def describe(entry):
            return {"config": entry[1], "us": round(entry[0], 2), "GBps": round(nbytes / entry[0] / 1e3)}

        results[shape] = {"start_up_best": describe(best_start_up) if best_start_up else None,
                          "grid_best": [describe(t) for t in timed[:5]], "configs": len(timed), "failed": failed}
        print(shape, results[shape], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
