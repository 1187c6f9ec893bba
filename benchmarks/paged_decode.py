"""The Triton paged decode kernel (kernels/triton/paged_decode.py) on a GPU at a large batch over long contexts,
bfloat16 KV cache against FP8 (e4m3): microseconds a layer and the bandwidth the cache reads make.

    python benchmarks/paged_decode.py [--batch 64] [--context 8192] [--heads 32] [--kv-heads 8] [--head-dim 128]
                                      [--caches bf16,fp8] [--rotate] [--splits N] [--configs JSON] [--out FILE]

Llama-3-8B's attention shape by default (32 query heads over 8 KV heads of 128), one layer. Each call is captured
in a CUDA graph and replayed (benchmarks/moe_kernels.graph_time_us). The cache holds random rows in 16-token
blocks, each sequence's blocks scattered; the bytes counted are the keys and values the step reads (batch x
context x KV heads x head_dim x 2, times the cache's element size). With --rotate the launch also normalises,
rotates and stores the step's new token, as the engine's decode-only steps run it (NewTokens); without, as
steps that also prefill do. --splits: the context splits (default: choose_num_splits, as the engine picks them).
--configs: a JSON list of launch-parameter overrides for the decode kernel (e.g. [{"BLOCK_N": 64},
{"num_stages": 2}]), each timed beside the default for every cache dtype; an override a kernel does not take
fails its row. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_kernels import graph_time_us  # noqa: E402
from benchmarks.result_file import report  # noqa: E402
from shardserve.kernels.triton import paged_decode as pd  # noqa: E402
from shardserve.layers.rotary import RotaryEmbedding  # noqa: E402

BLOCK_SIZE = 16
CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class _Overridden:
    """The decode kernel launched with some launch parameters replaced."""

    def __init__(self, kernel, overrides: dict) -> None:
        self.kernel, self.overrides = kernel, overrides

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **{**kwargs, **self.overrides})


def time_one(args, cache: str, overrides: dict, device) -> dict:
    batch, context, heads, kv_heads, dim = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks * BLOCK_SIZE, kv_heads, dim)
    k_cache = torch.randn(shape, device=device, generator=g).to(CACHES[cache])
    v_cache = torch.randn(shape, device=device, generator=g).to(CACHES[cache])
    tables = torch.randperm(num_blocks, device=device, generator=g).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim, device=device, generator=g).to(torch.bfloat16)
    q = qkv[:, :heads]
    out = torch.empty(batch, heads, dim, device=device, dtype=torch.bfloat16)
    counts = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
    new = None
    if args.rotate:
        rope = RotaryEmbedding(dim, context + 1, 500000.0, None, torch.bfloat16).to(device)
        last = lens.long() - 1
        slots = tables.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + last % BLOCK_SIZE
        new = pd.NewTokens(qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], slots, rope.cos,
                           rope.signed_sin)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = args.splits or pd.choose_num_splits(batch, kv_heads, context, sms, BLOCK_SIZE)
    scales = dict(k_scale=0.5, v_scale=0.25) if cache == "fp8" else {}
    kernel = pd._decode_kernel
    pd._decode_kernel = _Overridden(kernel, overrides)
    try:
        us = graph_time_us(lambda: pd.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5,
                                                             BLOCK_SIZE, splits, out=out, arrivals=counts,
                                                             new_tokens=new, **scales), args.iters, args.repeats)
    finally:
        pd._decode_kernel = kernel
    read = 2 * batch * context * kv_heads * dim * k_cache.element_size()
    return dict(cache=cache, config=overrides, splits=splits, us=round(us, 1), gbs=round(read / us / 1e3, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--caches", default="bf16,fp8")
    parser.add_argument("--rotate", action="store_true")
    parser.add_argument("--splits", type=int, default=0)
    parser.add_argument("--configs", default="[]")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for cache in args.caches.split(","):
        for overrides in [{}] + json.loads(args.configs):
            try:
                row = time_one(args, cache, overrides, device)
            except Exception as e:  # noqa: BLE001 - a config the kernel cannot take is reported, not fatal
                row = dict(cache=cache, config=overrides, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    default = {r["cache"]: r["us"] for r in rows if not r["config"] and "us" in r}
    result = dict(card=torch.cuda.get_device_name(device), batch=args.batch, context=args.context,
                  heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, rotate=args.rotate, rows=rows)
    if "bf16" in default and "fp8" in default:
        result["fp8_speedup"] = round(default["bf16"] / default["fp8"], 2)
    report(result, args.out)


if __name__ == "__main__":
    main()
