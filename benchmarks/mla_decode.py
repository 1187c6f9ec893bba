"""The Triton MLA decode kernel (kernels/triton/mla_decode.py) on a GPU: microseconds a layer and the bandwidth its
cache reads make, against the card's copy bandwidth measured in the same run.

    python benchmarks/mla_decode.py [--heads 16 128] [--batch 1 8 64] [--context 1024 8192 32768] [--out FILE]
        [--config 16,32,4 32,16,8 ...]   # launch configs to compare (BLOCK_H,BLOCK_N,num_warps), default the kernel's

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
from benchmarks.result_file import report  # noqa: E402
from shardserve.kernels.triton import mla_decode as kernel  # noqa: E402

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
    config = kernel.launch_config(heads)
    if splits is None:
        splits = kernel.latent_num_splits(batch, -(-heads // config["BLOCK_H"]), context, sms, config["BLOCK_N"])
    us = graph_time_us(lambda: kernel.mla_decode(q, cache, tables, lens, BLOCK_SIZE, 0.07, LATENT, splits, out),
                       50, 5)
    read = batch * context * (LATENT + ROPE) * 2
    return dict(heads=heads, batch=batch, context=context, splits=splits, us=round(us, 2),
                gbs=round(read / us / 1e3, 1), config=f"{config['BLOCK_H']},{config['BLOCK_N']},{config['num_warps']}")


def forced_config(text: str):
    """launch_config replaced by BLOCK_H,BLOCK_N,num_warps from `text`."""
    block_h, block_n, warps = map(int, text.split(","))
    return lambda heads: dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 32, 128])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--config", nargs="+", default=[None], help="BLOCK_H,BLOCK_N,num_warps to compare")
    parser.add_argument("--out")
    args = parser.parse_args()
    default_config = kernel.launch_config
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    rows = []
    for config in args.config:
        kernel.launch_config = default_config if config is None else forced_config(config)
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
    report(result, args.out)


if __name__ == "__main__":
    main()
