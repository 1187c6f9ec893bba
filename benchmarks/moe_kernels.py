"""The experts of one MoE layer on a GPU: the fused Triton kernel against torch's grouped GEMM, per token count.

    python benchmarks/moe_kernels.py [--shape qwen3-30b-a3b] [--tokens 1,2,4,...] [--sweep] [--one-token-sweep]
                                     [--out FILE]

Each call is captured in a CUDA graph and replayed (as the engine runs decode), timed with CUDA events over
--iters replays, median of --repeats. Reported per token count: microseconds per layer for each path, the bytes
of the experts the call had to read (the distinct chosen experts' w13 and w2) and the bandwidth that makes.
Routes are random (softmax top-k of Gaussian logits), the same for every path. The router_then_fused and
fused_from_logits paths include the router's choice from logits (two kernels against one launch for both where
the table fuses them); at one token the grouped GEMMs (fused_gemm, gemm_from_logits) and the matrix-vector path
(one_token, one_token_from_logits) are also timed by name; route_align_only and route_then_align_only time the
choice and alignment alone. --sweep also times every config of a small grid for the fused kernel and reports the
fastest beside the table's; --one-token-sweep the same for the one-token path's tiles. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.result_file import report  # noqa: E402
from shardserve.kernels.fused_moe_table import MoeConfig, OneTokenTiles, Tile  # noqa: E402

# (experts, top k, hidden, expert features) on one rank.
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3-235b-a22b-tp8": (128, 8, 4096, 192),
          "mixtral-8x7b-tp2": (8, 2, 4096, 7168)}


def graph_time_us(fn, iters: int, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(times)


def sweep_configs(rows_per_expert: float):
    """A grid around the table: row blocks near the expected rows per expert, a few tile shapes."""
    tiles = [Tile(n, k, w, s) for (n, k), (w, s) in itertools.product(
        itertools.product((32, 64, 128), (64, 128)), ((4, 3), (4, 4), (8, 3)))]
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 4 * rows_per_expert)][-2:]
    wide = [Tile(n, k, 8, s) for n, k, s in ((128, 64, 4), (256, 64, 3), (256, 32, 4), (128, 32, 4))]
    for block_m in block_ms:
        for up in tiles + (wide if block_m >= 64 else []):
            yield MoeConfig(block_m, up, up)


def wide_grid():
    for n, k, (w, s) in itertools.product((16, 32, 64, 128), (64, 128, 256),
                                          ((2, 3), (4, 3), (4, 4), (4, 5), (8, 3), (8, 4))):
        yield Tile(n, k, w, s)


def one_token_grid():
    """Tiles of the one-token path's products: block_n rows, block_k columns a step, warps, stages."""
    for n, k, (w, st) in itertools.product((2, 4, 8, 16), (128, 256, 512, 1024), ((4, 2), (4, 3), (8, 2))):
        if n * k <= 8192:
            yield Tile(n, k, w, st)


def best_of(time_config, configs) -> tuple[float, object]:
    best = None
    for config in configs:
        try:
            us = time_config(config)
        except Exception as exc:  # out of shared memory and the like: not a candidate
            print(f"skip {config}: {type(exc).__name__}", file=sys.stderr)
            continue
        if best is None or us < best[0]:
            best = (us, config)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-tokens", default="1,4,64,1024,4096", help="token counts to sweep at")
    parser.add_argument("--sweep-each-gemm", action="store_true",
                        help="with --sweep: also each GEMM's tile on its own over a wider grid")
    parser.add_argument("--one-token-sweep", action="store_true",
                        help="at 1 token: the one-token path's w13 tile over a grid (w2 tile as the table's), then "
                             "its w2 tile with the best w13 tile")
    parser.add_argument("--out")
    args = parser.parse_args()

    from shardserve.kernels.fused_moe_table import ONE_TOKEN_TILES, pick_config
    from shardserve.kernels.fused_moe_table import ROUTE_ALIGN_MAX_TOKENS
    from shardserve.kernels.triton.fused_moe import align_pairs, fused_moe, fused_moe_from_logits, route_and_align
    from shardserve.kernels.triton.moe_router import route_top_k
    from shardserve.layers.moe import grouped_mm_experts

    num_experts, top_k, hidden, inter = SHAPES[args.shape]
    dtype, device = torch.bfloat16, torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=device) * inter ** -0.5).to(dtype)
    expert_bytes = 3 * hidden * inter * dtype.itemsize
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        weights, ids = torch.topk(torch.softmax(torch.randn(tokens, num_experts, generator=g, device=device), -1),
                                  top_k, dim=-1)
        read = len(ids.unique()) * expert_bytes
        row = {"tokens": tokens, "bytes_read": read}
        logits = torch.randn(tokens, num_experts, generator=g, device=device).to(dtype)
        table = pick_config(tokens, top_k, num_experts)
        paths = [("fused", lambda: fused_moe(x, w13, w2, weights, ids)),
                 ("grouped_mm", lambda: grouped_mm_experts(x, w13, w2, weights, ids)),
                 # The router's choice included: its own kernel then the experts, or one launch for both.
                 ("router_then_fused", lambda: fused_moe(x, w13, w2, *route_top_k(logits, top_k, True))),
                 ("fused_from_logits", lambda: fused_moe_from_logits(x, logits, w13, w2, top_k, True))]
        if tokens == 1:  # the grouped GEMMs and the one-token path, each named (plain "fused" takes the default)
            tiles = ONE_TOKEN_TILES
            paths += [("fused_gemm", lambda: fused_moe(x, w13, w2, weights, ids, config=table)),
                      ("one_token", lambda: fused_moe(x, w13, w2, weights, ids, config=tiles)),
                      ("gemm_from_logits", lambda: fused_moe_from_logits(x, logits, w13, w2, top_k, True,
                                                                         config=table)),
                      ("one_token_from_logits", lambda: fused_moe_from_logits(x, logits, w13, w2, top_k, True,
                                                                              config=tiles))]
        if tokens <= ROUTE_ALIGN_MAX_TOKENS:  # the choice and the alignment alone: one launch against two
            block_m = table.block_m
            paths += [("route_align_only", lambda: route_and_align(logits, top_k, True, num_experts, block_m)),
                      ("route_then_align_only",
                       lambda: align_pairs(route_top_k(logits, top_k, True)[1], num_experts, block_m))]
        for name, fn in paths:
            us = graph_time_us(fn, args.iters, args.repeats)
            row[f"{name}_us"] = round(us, 1)
            row[f"{name}_gb_s"] = round(read / us / 1e3, 1)
        if args.sweep and str(tokens) in args.sweep_tokens.split(","):
            time_config = lambda config: graph_time_us(  # noqa: E731
                lambda: fused_moe(x, w13, w2, weights, ids, config=config), 20, 3)
            best = best_of(time_config, sweep_configs(tokens * top_k / num_experts))
            if args.sweep_each_gemm:
                # Each GEMM's tile alone over a wider grid: the up tile with the best down tile so far, then the
                # down tile with that up tile.
                up = best_of(time_config, (MoeConfig(best[1].block_m, tile, best[1].down) for tile in wide_grid()))
                down = best_of(time_config, (MoeConfig(best[1].block_m, up[1].up, tile) for tile in wide_grid()))
                best = min((best, up, down), key=lambda b: b[0])
            row["sweep_best_us"] = round(best[0], 1)
            row["sweep_best_config"] = repr(best[1])
            row["table_config"] = repr(table)
        if args.one_token_sweep and tokens == 1:
            time_tiles = lambda tiles: graph_time_us(  # noqa: E731
                lambda: fused_moe(x, w13, w2, weights, ids, config=tiles), 20, 3)
            up = best_of(time_tiles, (OneTokenTiles(t, ONE_TOKEN_TILES.down) for t in one_token_grid()))
            best = best_of(time_tiles, (OneTokenTiles(up[1].up, t) for t in one_token_grid()))
            row["one_token_sweep_best_us"] = round(best[0], 1)
            row["one_token_sweep_best_tiles"] = repr(best[1])
            row["one_token_table_tiles"] = repr(ONE_TOKEN_TILES)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    result = {"shape": args.shape, "experts": num_experts, "top_k": top_k, "hidden": hidden,
              "expert_features": inter, "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
              "rows": rows}
    report(result, args.out, print_indent=1)


if __name__ == "__main__":
    main()
