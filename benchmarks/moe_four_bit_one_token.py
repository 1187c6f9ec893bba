"""A single token's 4-bit experts on a GPU: fused_moe's one-token kernels (each weight dequantized in float32 with
its scale) against moe_four_bit's float16 pair sums (what the packed experts run), and a sweep of the latter's
tiles.

    python benchmarks/moe_four_bit_one_token.py [--shape nemotron3-nano-30b-a3b] [--kind fp4|int4] [--group 16]
        [--sweep] [--out FILE]

Random codes and scales (the values do not change the time), bfloat16 activations, the routed choices of one
token (top k of random logits). Each call is captured in a CUDA graph and replayed, timed with CUDA events
(benchmarks/moe_kernels.graph_time_us). Reported: microseconds a layer's experts, the bytes the chosen experts'
codes and scales take (fp4: an e4m3 byte a group and a float32 scale a row), the bandwidth that makes, and each
path's relative error against float64. One JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_kernels import best_of, graph_time_us  # noqa: E402
from benchmarks.moe_packed_one_token import random_packed  # noqa: E402
from shardserve.kernels.fused_moe_table import OneTokenTiles, Tile  # noqa: E402

# (experts, top k, hidden, expert features, activation) on one rank.
SHAPES = {"nemotron3-nano-30b-a3b": (128, 6, 2688, 1856, "relu2"), "qwen3-30b-a3b": (128, 8, 2048, 768, "swiglu")}


def weight_bytes(kind: str, rows: int, k: int, group: int) -> float:
    """Bytes of `rows` packed rows of K columns: half a byte a code, a scale (int4: a scale-and-zero word) a group;
    fp4's e4m3 byte a group and a float32 scale a row."""
    from shardserve.kernels.quant_pack import scale_dtype

    return rows * (k / 2 + k // group * scale_dtype(kind).itemsize + (4 if kind == "fp4" else 0))


def experts_bytes(shape: str, kind: str, group: int, shared_slots: int = 0) -> float:
    """Bytes one token's chosen experts (and the shared expert's slots) read: their up and down rows."""
    _, top_k, hidden, inter, activation = SHAPES[shape]
    up_rows = 2 * inter if activation == "swiglu" else inter
    return (top_k + shared_slots) * (weight_bytes(kind, up_rows, hidden, group)
                                     + weight_bytes(kind, hidden, inter, group))


def one_token_experts(shape: str, kind: str, group: int, shared_slots: int = 0):
    """(x [1, H] bfloat16, random packed experts, the routed weights and ids of one token (top k of random logits),
    the shared expert as `shared_slots` slots of the experts' width or None) on the GPU, for SHAPES[shape]."""
    from shardserve.kernels.triton.moe_four_bit import SharedSlots

    num_experts, top_k, hidden, inter, activation = SHAPES[shape]
    device = torch.device("cuda")
    experts = random_packed(kind, num_experts, hidden, inter, group, device, activation)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, hidden, generator=g, device=device).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(1, num_experts, generator=g, device=device), -1), top_k,
                              dim=-1)
    shared = None
    if shared_slots:  # the shared expert's tensors: a block of experts' slots, as [S, H / 2] and [H, S / 2]
        extra = random_packed(kind, shared_slots, hidden, inter, group, device, activation)
        features = shared_slots * inter
        rows = ()
        if kind == "fp4":  # the down rows' row scales: every slot's columns of a row share one
            rows = (extra.row13.reshape(features), extra.row2[0].contiguous())
        shared = SharedSlots(extra.w13.reshape(features, -1), extra.scale13.reshape(features, -1),
                             extra.w2.permute(1, 0, 2).reshape(hidden, -1).contiguous(),
                             extra.scale2.permute(1, 0, 2).reshape(hidden, -1).contiguous(), shared_slots, *rows)
    return x, experts, weights, ids, shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="nemotron3-nano-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--kind", default="fp4", choices=("fp4", "int4"))
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shared-slots", type=int, default=0,
                        help="a non-gated shared expert of this many times the experts' width, in the same launches")
    parser.add_argument("--out")
    args = parser.parse_args()

    from shardserve.kernels.fused_moe_table import ONE_TOKEN_PACKED_TILES
    from shardserve.kernels.triton.fused_moe import fused_moe_packed
    from shardserve.kernels.triton.moe_four_bit import FOUR_BIT_PAIR_TILES, one_token_four_bit_experts
    from shardserve.layers.moe import reference_experts

    x, experts, weights, ids, shared = one_token_experts(args.shape, args.kind, args.group, args.shared_slots)
    top_k = SHAPES[args.shape][1]
    read = experts_bytes(args.shape, args.kind, args.group, args.shared_slots)
    row = {"shape": args.shape, "kind": args.kind, "group": args.group, "choices": top_k, "bytes_read": int(read),
           "device": torch.cuda.get_device_name()}
    want = reference_experts(x, None, None, weights, ids, packed=experts)
    if shared is not None:
        row["shared_slots"] = args.shared_slots

    def timed(name: str, fn) -> float:
        row[f"{name}_relative_error"] = float((fn().double() - want).norm() / want.norm())
        us = graph_time_us(fn, args.iters, args.repeats)
        row[f"{name}_us"], row[f"{name}_gb_s"] = round(us, 2), round(read / us / 1e3, 1)
        return us

    timed("float32_dequantized", lambda: fused_moe_packed(x, experts, weights, ids, config=ONE_TOKEN_PACKED_TILES))
    if shared is None:
        timed("float16_pairs", lambda: one_token_four_bit_experts(x, experts, weights, ids, FOUR_BIT_PAIR_TILES))
    else:  # the error against the routed experts alone is not a check here: the shared slots add to them
        us = graph_time_us(lambda: one_token_four_bit_experts(x, experts, weights, ids, FOUR_BIT_PAIR_TILES, shared),
                           args.iters, args.repeats)
        row["float16_pairs_with_shared_us"] = round(us, 2)
        row["float16_pairs_with_shared_gb_s"] = round(read / us / 1e3, 1)
    if args.sweep:
        tiles = [Tile(n, k, w, 1) for n, k, w in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8))]
        swept = []

        def time_tiles(candidate: OneTokenTiles) -> float:
            us = graph_time_us(lambda: one_token_four_bit_experts(x, experts, weights, ids, candidate, shared), 30, 3)
            swept.append((round(us, 2), repr(candidate)))
            return us

        up = best_of(time_tiles, (OneTokenTiles(t, FOUR_BIT_PAIR_TILES.down) for t in tiles))
        best = best_of(time_tiles, (OneTokenTiles(up[1].up, t) for t in tiles))
        row["sweep_best_us"], row["sweep_best_tiles"] = round(best[0], 2), repr(best[1])
        row["sweep_best_gb_s"] = round(read / best[0] / 1e3, 1)
        row["sweep"] = sorted(swept)
    print(json.dumps(row, indent=1))
    if args.sweep:  # the best tiles in SHARDSERVE_MOE_FOUR_BIT_TILES' form, last
        best_up, best_down = best[1].up, best[1].down
        print("/".join(f"{t.block_n},{t.block_k},{t.num_warps},{t.num_stages}" for t in (best_up, best_down)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
