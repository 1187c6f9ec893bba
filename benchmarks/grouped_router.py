"""A grouped top-k router's choice for few tokens on a GPU: torch's grouped_top_k (about ten launches) against the
one-launch kernel (kernels/triton/grouped_router.py), with and without programmatic dependent launch.

    python benchmarks/grouped_router.py [--tokens 1] [--chain 20] [--iters 50] [--repeats 5] [--out FILE]

Each measurement captures --chain calls one after another in a CUDA graph and replays it, timed with CUDA events
(median of --repeats runs of --iters replays), so a figure is microseconds a call with the graph's own launch
spread over the chain. "route": the choice alone on the same float32 logits; "router": the router's float32 GEMV
(hidden 2048, torch's F.linear) then the choice, as GroupedTopKRouter.forward runs them. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.moe_kernels import graph_time_us  # noqa: E402
from shardserve import envs  # noqa: E402
from shardserve.config import GroupedTopK  # noqa: E402
from shardserve.kernels.triton.grouped_router import grouped_route  # noqa: E402
from shardserve.layers.grouped_topk import grouped_top_k  # noqa: E402

# name: (route, bias)
ROUTES = {"moonlight-64e-top6": (GroupedTopK(64, 6, scaling_factor=2.446), True),
          "128e-top6": (GroupedTopK(128, 6, scaling_factor=2.5), True),
          "deepseek-v3-256e-top8-8g4": (GroupedTopK(256, 8, 8, 4, scaling_factor=2.5), True),
          "deepseek-v2-160e-top6-8g3-softmax": (GroupedTopK(160, 6, 8, 3, False, 16.0, "softmax"), False)}
HIDDEN = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--chain", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(device), "chain": args.chain, "routes": {}}
    g = torch.Generator(device=device).manual_seed(0)
    for name, (route, has_bias) in ROUTES.items():
        weight = torch.randn(route.num_experts, HIDDEN, generator=g, device=device) * HIDDEN ** -0.5
        bias = torch.randn(route.num_experts, generator=g, device=device) * 0.1 if has_bias else None
        for tokens in map(int, args.tokens.split(",")):
            h = torch.randn(tokens, HIDDEN, generator=g, device=device)
            logits = F.linear(h, weight)
            row = {}
            for path, choose in (("torch", grouped_top_k), ("kernel", grouped_route)):
                for pdl in (("on", "off") if path == "kernel" else ("off",)):
                    with envs.override(SHARDSERVE_PDL=pdl):
                        def route_only(choose=choose):
                            for _ in range(args.chain):
                                choose(logits, bias, route)

                        def router(choose=choose):
                            for _ in range(args.chain):
                                choose(F.linear(h, weight), bias, route)

                        label = path if path == "torch" else f"kernel-pdl-{pdl}"
                        row[f"route/{label}"] = graph_time_us(route_only, args.iters, args.repeats) / args.chain
                        row[f"router/{label}"] = graph_time_us(router, args.iters, args.repeats) / args.chain
            results["routes"][f"{name}/T={tokens}"] = {k: round(v, 2) for k, v in row.items()}
            print(name, tokens, results["routes"][f"{name}/T={tokens}"], file=sys.stderr, flush=True)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
