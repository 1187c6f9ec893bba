"""One Mamba-2 layer's decode step on a GPU: the three launches (convolution, SSM step, grouped gated norm) against
the one kernel that does all three (kernels/triton/mamba2_decode.py), at Nemotron-3-Nano-30B-A3B's sizes on one rank
(64 heads of 64 x 128 in 8 groups, a four-tap convolution with bias, bfloat16, float32 states).

    python benchmarks/mamba2_decode.py [--rows 1,4] [--layers 23] [--repeats 15]

Each form runs as a CUDA graph of `layers` decode steps, each layer with its own weights and state pools (2 MB of
float32 states a row and layer), replayed 20 times per repeat (benchmarks/deltanet_decode.us_per_layer). Prints one
JSON line: per batch size, microseconds a layer for each form (the median over repeats), the time saved, the
bandwidth the one kernel's state traffic reaches, and the largest difference between the two forms' outputs relative
to the output's largest value (one eager step from the same states). The one kernel launches with dependent launch
where the GPU has it (kernels/triton/pdl.py); the three do not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.deltanet_decode import us_per_layer  # noqa: E402

CONV_KERNEL = 4


def layer(rows: int, heads: int, head_dim: int, state: int, groups: int, g: torch.Generator) -> dict:
    """One layer's inputs to step_and_norm_in_pool: random weights and projection outputs (z, xbc and dt views into
    one row, as the layer splits them), one state slot a row."""
    inner = heads * head_dim
    channels = inner + 2 * groups * state

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    z, xbc, dt = rand(rows, inner + channels + heads).split([inner, channels, heads], dim=1)
    return dict(xbc=xbc, dt=dt, z=z, conv_weight=rand(channels, CONV_KERNEL, scale=0.5), conv_bias=rand(channels),
                a_log=rand(heads, dtype=torch.float32), d=rand(heads, dtype=torch.float32),
                dt_bias=rand(heads, dtype=torch.float32), time_step_limit=(0.0, float("inf")), groups=groups,
                norm_weight=1 + rand(inner, scale=0.1), group_size=inner // groups, eps=1e-5,
                conv_pool=rand(rows, channels, CONV_KERNEL - 1),
                ssm_pool=rand(rows, heads, head_dim, state, scale=0.1, dtype=torch.float32),
                slots=torch.arange(rows, device="cuda"))


def fused(**inputs) -> torch.Tensor:
    from shardserve.kernels.triton.mamba2_decode import step_and_norm_in_pool

    out = step_and_norm_in_pool(**inputs)
    if out is None:
        raise RuntimeError("the one kernel did not run (arrival counts too few, or norm groups not the B/C groups)")
    return out


def three_kernels(**inputs) -> torch.Tensor:
    from shardserve.layers.mamba2_kernels import TritonDecodeMamba2Kernels

    return TritonDecodeMamba2Kernels.step_and_norm_in_pool(**inputs)


def relative_difference(inputs: dict) -> float:
    """max |one kernel - three kernels| / max |three kernels| over one eager step from the same states."""
    outs = []
    for step in (fused, three_kernels):
        pools = {name: inputs[name].clone() for name in ("conv_pool", "ssm_pool")}
        outs.append(step(**{**inputs, **pools}).float())
    return ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--layers", type=int, default=23)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    from shardserve.kernels.triton import pdl

    device = torch.device("cuda", torch.cuda.current_device())
    results = {"device": torch.cuda.get_device_name(device), "dependent_launch": pdl.describe(device),
               "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim, "state": args.state,
               "groups": args.groups}
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        layers = [layer(rows, args.heads, args.head_dim, args.state, args.groups, g) for _ in range(args.layers)]
        row = {"max_rel_diff": relative_difference(layers[0])}
        row["three_kernels_us"] = us_per_layer(three_kernels, layers, args.repeats)
        row["one_kernel_us"] = us_per_layer(fused, layers, args.repeats)
        row["saved_us"] = row["three_kernels_us"] - row["one_kernel_us"]
        state_bytes = sum(layers[0][name].numel() * layers[0][name].element_size() * 2  # read and written
                          for name in ("conv_pool", "ssm_pool"))
        row["one_kernel_state_TBps"] = state_bytes / (row["one_kernel_us"] * 1e-6) / 1e12
        results[f"rows_{rows}"] = row
    print(json.dumps(results))


if __name__ == "__main__":
    main()
