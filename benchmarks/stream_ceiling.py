"""How fast one launch can stream a given number of bytes on this GPU, beside the batch-1 FP8 GEMVs of
Qwen3-Next-80B-A3B's projections at the same sizes: the ceiling a decode step's short launches can reach.

    python3 benchmarks/stream_ceiling.py [--out FILE]

Every launch is timed inside a CUDA graph of `--launches` launches in a row, each on its own copy of the data (more
bytes than the L2 holds in all), median of `--repeats` replays; us a launch and GB/s of the bytes it reads.

- stream: a Triton kernel that sums int32 words (each program `iters` tiles of `block` words), over a grid of
  (block, iters, warps): the fastest is the ceiling for that size.
- fp8 GEMV: quant_gemv.fp8_gemv on [N, K] FP8 weights with 128 x 128 block scales (expanded a row each, as the engine
  holds them), every configuration of the format's candidates (float32 sums, and float16 sums of groups that
  runs of rows share), and one scale a row for comparison.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_kernels import graph_time_us  # noqa: E402

SIZES_MB = (2, 4, 8, 12, 16, 24, 32, 48)
# Qwen3-Next-80B-A3B at TP=1: (N, K) of in_proj_qkvz, out_proj, the attention's q|k|v and o, in_proj_ba.
GEMV_SHAPES = {"qkvz": (12288, 2048), "out_proj": (2048, 4096), "attn_qkv": (9216, 2048), "ba": (64, 2048)}
L2_BYTES = 256 << 20  # each graph's copies together exceed any L2 by this much


@triton.jit
def _stream_kernel(src, out, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n_words, other=0, eviction_policy="evict_first")
    tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))


def graph_us(launches: list, repeats: int) -> float:
    """us a launch: the launches captured in one graph, replayed `repeats` times (median)."""
    return graph_time_us(lambda: [launch() for launch in launches], 1, repeats) / len(launches)


def copies(nbytes: int, count: int) -> int:
    return max(count, -(-L2_BYTES // nbytes))


def stream_rows(launches: int, repeats: int) -> dict:
    results = {}
    for mb in SIZES_MB:
        n_words = (mb << 20) // 4
        bufs = [torch.randint(0, 7, (n_words,), dtype=torch.int32, device="cuda")
                for _ in range(copies(n_words * 4, launches))]
        out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
        best = None
        for block, iters, warps in itertools.product((512, 1024, 2048, 4096), (1, 2, 4, 8), (4, 8)):
            grid = (triton.cdiv(n_words, block * iters),)
            calls = [lambda b=bufs[i % len(bufs)]: _stream_kernel[grid](b, out, n_words, BLOCK=block, ITERS=iters,
                                                                       num_warps=warps)
                     for i in range(max(launches, len(bufs)))]
            us = graph_us(calls, repeats)
            if best is None or us < best[0]:
                best = (us, f"{block}x{iters}/{warps}w")
        results[f"{mb}MB"] = {"us": round(best[0], 2), "GBps": round((mb << 20) / best[0] / 1e3, 1),
                              "config": best[1]}
        print(mb, results[f"{mb}MB"], flush=True)
        del bufs
    return results


def gemv_rows(launches: int, repeats: int) -> dict:
    from shardserve.kernels.triton.quant_gemv import fp8_gemv, rows_share_scales
    from shardserve.layers.quantization.base import GEMV_CANDIDATES
    from shardserve.layers.quantization.fp8 import FP8_F16_CANDIDATES, quantize_fp8

    results = {}
    for name, (n, k) in GEMV_SHAPES.items():
        dense = torch.randn(n, k, device="cuda") * k ** -0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k
        count = copies(nbytes, launches)
        row = {}
        for label, group, block_rows in (("block128", 128, 128), ("per_row", k, 1)):
            q, scale = quantize_fp8(dense, group, block_rows)
            weights = [(q.clone(), scale.clone()) for _ in range(count)]
            share = rows_share_scales(scale)
            configs = [(*c, 0) for c in GEMV_CANDIDATES] + [c for c in FP8_F16_CANDIDATES
                                                            if group == k or c[0] <= share]
            best = None
            for config in configs:
                calls = [lambda w=weights[i % count], c=config: fp8_gemv(x, w[0], w[1], group, *c[:4], f16_sums=c[4])
                         for i in range(max(launches, count))]
                try:
                    us = graph_us(calls, repeats)
                except Exception as exc:  # a configuration that does not build here
                    print(name, label, config, type(exc).__name__, flush=True)
                    continue
                row[f"{label}_{'_'.join(map(str, config))}"] = round(us, 2)
                if best is None or us < best[0]:
                    best = (us, config)
            row[f"{label}_best_us"] = round(best[0], 2)
            row[f"{label}_best_GBps"] = round(nbytes / best[0] / 1e3, 1)
            row[f"{label}_best"] = list(best[1])
            del weights
        results[name] = row
        print(name, {key: v for key, v in row.items() if "best" in key}, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=24)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-gemv", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    result = {"device": torch.cuda.get_device_name(), "stream": stream_rows(args.launches, args.repeats)}
    if not args.skip_gemv:
        result["fp8_gemv"] = gemv_rows(args.launches, args.repeats)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
