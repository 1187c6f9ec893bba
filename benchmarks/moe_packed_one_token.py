"""One MoE layer's packed experts (FP8 or 4-bit) for a single token on a GPU: the grouped GEMMs of the table against
the one-token matrix-vector path, and a sweep of the one-token path's tiles.

    python benchmarks/moe_packed_one_token.py [--shape qwen3-next-80b-a3b] [--kind fp8|int4] [--sweep] [--out FILE]

Each call is captured in a CUDA graph and replayed, timed with CUDA events (median of --repeats runs of --iters
replays). The experts are random codes with random scales; the k + 1 choices are k routed experts and the shared
expert folded in as expert E (layers/moe_shared.py) where the shape has one. Reported: microseconds a layer, the
bytes the chosen experts' packed weights and scales take, and the bandwidth that makes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_kernels import best_of, graph_time_us  # noqa: E402
from benchmarks.result_file import report  # noqa: E402
from shardserve.kernels.fused_moe_table import OneTokenTiles, Tile  # noqa: E402

# (routed experts, top k, hidden, expert features, shared expert folded) on one rank.
SHAPES = {"qwen3-next-80b-a3b": (512, 10, 2048, 512, True), "qwen3-30b-a3b": (128, 8, 2048, 768, False),
          "qwen3.5-397b-a17b-tp4": (512, 10, 4096, 256, True)}


def random_packed(kind: str, experts: int, hidden: int, inter: int, group: int, device, activation: str = "swiglu"):
    """Random packed experts: fp8, int4 or fp4 codes with small positive scales (int4: some zero point; fp4: e4m3
    group scales under a float32 scale a row); SwiGLU experts hold gate and up rows, others up rows only."""
    from shardserve.kernels.packed_experts import PackedExperts
    from shardserve.kernels.quant_pack import fp4_scale_bytes, scale_dtype

    g = torch.Generator(device=device).manual_seed(0)

    def part(n: int, k: int):
        if kind == "fp8":
            codes = (torch.randn(experts, n, k, generator=g, device=device) * 100).clamp(-448, 448).to(
                torch.float8_e4m3fn)
            scale = torch.rand(experts, n, k // group, generator=g, device=device) * 1e-3
            return codes, scale.to(scale_dtype(kind))
        codes = torch.randint(0, 256, (experts, n, k // 2), generator=g, device=device, dtype=torch.uint8)
        if kind == "fp4":  # group scales 1e-3 to 1.1e-2 as e4m3 values 40 to 448 times a row scale near 2.5e-5
            e4m3 = (torch.rand(experts, n, k // group, generator=g, device=device) * 408 + 40).to(torch.float8_e4m3fn)
            rows = (torch.rand(experts, n, generator=g, device=device) * 0.1 + 0.95) * 2.5e-5
            return codes, fp4_scale_bytes(e4m3), rows
        return codes, torch.randint(0, 2 ** 20, (experts, n, k // group), generator=g, device=device,
                                    dtype=torch.int32) | (0x3C << 24)

    up, down = part(2 * inter if activation == "swiglu" else inter, hidden), part(hidden, inter)
    rows = (up[2], down[2]) if kind == "fp4" else ()
    return PackedExperts(kind, up[0], up[1], group, down[0], down[1], group, activation, *rows)


def tile_grid():
    """Tiles of 1 to 16 KiB of codes a program (at most 16 rows, 256 to 2048 columns), 2 to 8 warps."""
    for n, k, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
        if 1024 <= n * k <= 16384:
            yield Tile(n, k, w, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-next-80b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--kind", default="fp8", choices=("fp8", "int4"))
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="also a prefill chunk of this many tokens")
    parser.add_argument("--out")
    args = parser.parse_args()

    from shardserve.kernels.fused_moe_table import ONE_TOKEN_PACKED_TILES, pick_config
    from shardserve.kernels.triton.fused_moe import fused_moe_packed
    from shardserve.layers.moe import reference_experts

    routed, top_k, hidden, inter, shared = SHAPES[args.shape]
    device = torch.device("cuda")
    experts = random_packed(args.kind, routed + shared, hidden, inter, args.group, device)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, hidden, generator=g, device=device).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(1, routed, generator=g, device=device), -1), top_k, dim=-1)
    if shared:
        weights = torch.cat([weights, torch.full((1, 1), 0.5, device=device)], 1)
        ids = torch.cat([ids, torch.full((1, 1), routed, device=device, dtype=ids.dtype)], 1)
    choices = ids.shape[1]
    per_byte = 2 if args.kind == "int4" else 1
    read = choices * (3 * hidden * inter // per_byte + 3 * hidden * inter // args.group * 4)
    table = pick_config(1, choices, experts.num_experts)
    row = {"shape": args.shape, "kind": args.kind, "group": args.group, "choices": choices, "bytes_read": read,
           "device": torch.cuda.get_device_name()}
    want = reference_experts(x, None, None, weights, ids, packed=experts)
    for name, config in (("grouped_gemm", table), ("one_token", ONE_TOKEN_PACKED_TILES)):
        got = fused_moe_packed(x, experts, weights, ids, config=config).double()
        row[f"{name}_relative_error"] = float((got - want).norm() / want.norm())
        us = graph_time_us(lambda: fused_moe_packed(x, experts, weights, ids, config=config), args.iters,
                           args.repeats)
        row[f"{name}_us"], row[f"{name}_gb_s"] = round(us, 2), round(read / us / 1e3, 1)
    from shardserve.kernels.triton.moe_router import route_top_k

    logits = torch.randn(1, routed + shared, generator=g, device=device).to(torch.bfloat16)
    for warps in (1, 2, 4, 8):  # the router's choice alone (with the shared expert's gate where folded)
        us = graph_time_us(lambda: route_top_k(logits, top_k, True, bool(shared), num_warps=warps), args.iters,
                           args.repeats)
        row[f"route_{warps}_warps_us"] = round(us, 2)
    if args.prefill_tokens:  # a prefill chunk: the routed experts alone, with the shared one as expert E, apart
        t = args.prefill_tokens
        xs = torch.randn(t, hidden, generator=g, device=device).to(torch.bfloat16)
        rw, ri = torch.topk(torch.softmax(torch.randn(t, routed, generator=g, device=device), -1), top_k, dim=-1)
        sw = torch.cat([rw, torch.full((t, 1), 0.5, device=device)], 1)
        si = torch.cat([ri, torch.full((t, 1), routed, device=device, dtype=ri.dtype)], 1)
        row[f"prefill_{t}_routed_us"] = round(graph_time_us(lambda: fused_moe_packed(xs, experts, rw, ri), 5, 3), 1)
        row[f"prefill_{t}_with_shared_us"] = round(graph_time_us(lambda: fused_moe_packed(xs, experts, sw, si), 5,
                                                                3), 1)

        def shared_apart():
            w13, w2 = experts.expert(routed, torch.bfloat16)
            gate, up = torch.nn.functional.linear(xs, w13).chunk(2, dim=-1)
            return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2)

        row[f"prefill_{t}_shared_apart_us"] = round(graph_time_us(shared_apart, 5, 3), 1)
        plogits = torch.randn(t, routed + shared, generator=g, device=device).to(torch.bfloat16)
        for warps in (2, 4):
            row[f"prefill_{t}_route_{warps}_warps_us"] = round(graph_time_us(
                lambda: route_top_k(plogits, top_k, True, bool(shared), num_warps=warps), 5, 3), 1)
    if args.sweep:
        time_tiles = lambda tiles: graph_time_us(  # noqa: E731
            lambda: fused_moe_packed(x, experts, weights, ids, config=tiles), 30, 3)
        timed = []

        def timed_tiles(tiles):
            us = time_tiles(tiles)
            timed.append((round(us, 2), repr(tiles)))
            return us

        up = best_of(timed_tiles, (OneTokenTiles(t, ONE_TOKEN_PACKED_TILES.down) for t in tile_grid()))
        best = best_of(timed_tiles, (OneTokenTiles(up[1].up, t) for t in tile_grid()))
        row["sweep_best_us"], row["sweep_best_tiles"] = round(best[0], 2), repr(best[1])
        row["sweep"] = sorted(timed)
        row["sweep_best_gb_s"] = round(read / best[0] / 1e3, 1)
    report(row, args.out, print_indent=1)


if __name__ == "__main__":
    main()
