"""The Triton MLA decode kernel (kernels/triton/mla_decode.py) on a GPU: microseconds a layer and the bandwidth its
cache reads make, against the card's copy bandwidth measured in the same run.

    python benchmarks/mla_decode.py [--heads 16 128] [--batch 1 8 64] [--context 1024 8192 32768] [--out FILE]

Each call is captured in a CUDA graph and replayed (benchmarks/moe_kernels.graph_time_us). The cache holds random
bf16 rows of DeepSeek-V3's width (512 latent + 64 rope) in 16-token blocks, each sequence's blocks scattered. The
bytes counted are the cached rows the step reads (batch x context x 576 x 2); the fraction is of the copy
bandwidth. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_kernels import graph_time_us  # noqa: E402
from shardserve.kernels.triton.mla_decode import head_block, mla_decode  # noqa: E402
from shardserve.kernels.triton.paged_decode import choose_num_splits  # noqa: E402

LATENT, ROPE, BLOCK_SIZE = 512, 64, 16


def copy_bandwidth_gbs(device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), 10, 5)
    return 2 * src.numel() / us / 1e3


def time_one(heads: int, batch: int, context: int, device, splits: int | None = None) -> dict:
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(num_blocks * BLOCK_SIZE, LATENT + ROPE, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, LATENT + ROPE, device=device, dtype=torch.bfloat16)
    out = torch.empty(batch, heads, LATENT, device=device, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if splits is None:
        splits = choose_num_splits(batch, triton_cdiv(heads, head_block(heads)), context, sms)
    us = graph_time_us(lambda: mla_decode(q, cache, tables, lens, BLOCK_SIZE, 0.07, LATENT, splits, out), 50, 5)
    read = batch * context * (LATENT + ROPE) * 2
    return dict(heads=heads, batch=batch, context=context, splits=splits, us=round(us, 2),
                gbs=round(read / us / 1e3, 1))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 32, 128])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    rows = []
    for heads in args.heads:
        for batch in args.batch:
            for context in args.context:
                if batch * context > 64 * 32768:
                    continue
                row = time_one(heads, batch, context, device)
                row["of_copy"] = round(row["gbs"] / copy, 3)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    result = dict(card=torch.cuda.get_device_name(device), copy_gbs=round(copy, 1), rows=rows)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
