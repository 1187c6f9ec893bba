"""One Gated DeltaNet layer's decode step on a GPU: the three launches (convolution, delta rule, gated norm) against
the one kernel that does all three (kernels/triton/deltanet_decode.py), at Qwen3-Next-80B-A3B's head sizes on one
rank (16 key heads, 32 value heads of 128 x 128, a four-tap convolution, bfloat16).

    python benchmarks/deltanet_decode.py [--rows 1,4] [--layers 36] [--repeats 15] [--shapes 16:2,32:4]

Each form runs as a CUDA graph of `layers` decode steps, each layer with its own weights and state pools (2 MB of
float32 states a row and layer: 72 MB over 36 layers, more than the L2 holds, so the states stream from memory as
in the model), replayed 20 times per repeat. Prints one JSON line: per batch size, microseconds a layer for each
form (the median over repeats), the time saved, the bandwidth the one kernel's state traffic reaches, and the
largest difference between the two forms' outputs relative to the output's largest value (one eager step from the
same states). The one kernel launches with dependent launch where the GPU has it (kernels/triton/pdl.py); the
three do not. --shapes also times the one kernel at other launch shapes (value columns a program owns:warps).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_kernels import graph_time_us  # noqa: E402

CONV_KERNEL = 4


def layer(rows: int, key_heads: int, value_heads: int, dim: int, g: torch.Generator) -> dict:
    """One layer's inputs to step_and_norm_in_pool: random weights and projection outputs (qkv and z views into one
    row, as the layer splits them), one state slot a row."""
    channels = 2 * key_heads * dim + value_heads * dim

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    qkvz = rand(rows, channels + value_heads * dim)
    return dict(qkv=qkvz[:, :channels], ba=rand(rows, 2 * value_heads), z=qkvz[:, channels:],
                conv_weight=rand(channels, CONV_KERNEL, scale=0.5), a_log=rand(value_heads, dtype=torch.float32),
                dt_bias=rand(value_heads, dtype=torch.float32), norm_weight=1 + rand(dim, scale=0.1), eps=1e-6,
                scale=dim ** -0.5, key_heads=key_heads, conv_pool=rand(rows, channels, CONV_KERNEL - 1),
                rec_pool=rand(rows, value_heads, dim, dim, scale=0.1, dtype=torch.float32),
                slots=torch.arange(rows, device="cuda"))


def fused(**inputs) -> torch.Tensor:
    from shardserve.kernels.triton.deltanet_decode import step_and_norm_in_pool

    out = step_and_norm_in_pool(**inputs)
    if out is None:
        raise RuntimeError("the one kernel found no arrival counts for this batch (too many rows x key heads)")
    return out


def three_kernels(**inputs) -> torch.Tensor:
    from shardserve.layers.deltanet_kernels import TritonDecodeDeltaNetKernels

    return TritonDecodeDeltaNetKernels.step_and_norm_in_pool(**inputs)


def us_per_layer(step, layers: list[dict], repeats: int, replays: int = 20) -> float:
    """The median over `repeats` of a CUDA graph of one step a layer, replayed `replays` times, per layer."""
    for inputs in layers:
        step(**inputs)  # compiles the kernels; the first eager call makes the arrival counts
    return graph_time_us(lambda: [step(**inputs) for inputs in layers], replays, repeats) / len(layers)


def relative_difference(inputs: dict) -> float:
    """max |one kernel - three kernels| / max |three kernels| over one eager step from the same states."""
    outs = []
    for step in (fused, three_kernels):
        pools = {name: inputs[name].clone() for name in ("conv_pool", "rec_pool")}
        outs.append(step(**{**inputs, **pools}).float())
    return ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--shapes", default="", help="other launch shapes of the one kernel, block:warps comma-separated")
    args = p.parse_args()
    from shardserve.kernels.triton import pdl

    device = torch.device("cuda", torch.cuda.current_device())
    results = {"device": torch.cuda.get_device_name(device), "dependent_launch": pdl.describe(device),
               "layers": args.layers, "key_heads": args.key_heads, "value_heads": args.value_heads, "dim": args.dim}
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        layers = [layer(rows, args.key_heads, args.value_heads, args.dim, g) for _ in range(args.layers)]
        row = {"max_rel_diff": relative_difference(layers[0])}
        row["three_kernels_us"] = us_per_layer(three_kernels, layers, args.repeats)
        row["one_kernel_us"] = us_per_layer(fused, layers, args.repeats)
        row["saved_us"] = row["three_kernels_us"] - row["one_kernel_us"]
        state_bytes = sum(layers[0][name].numel() * layers[0][name].element_size() * 2  # read and written
                          for name in ("conv_pool", "rec_pool"))
        row["one_kernel_state_TBps"] = state_bytes / (row["one_kernel_us"] * 1e-6) / 1e12
        for shape in filter(None, args.shapes.split(",")):
            block, warps = map(int, shape.split(":"))
            step = functools.partial(fused, value_block=block, num_warps=warps)
            row[f"one_kernel_{block}x{warps}_us"] = us_per_layer(step, layers, args.repeats)
        results[f"rows_{rows}"] = row
    print(json.dumps(results))


if __name__ == "__main__":
    main()
