"""A token's fp4 experts in one warp-specialised launch (fp4_one_launch_specialised.cu) against the two launches of
kernels/cuda/fp4_products.cu, at Nemotron-3-Nano's NVFP4 shapes (6 routed choices and the shared expert as 2 slots).

Checks that the one launch gives the two launches' bits (every choice held, and one left out; again after many
launches, since its flags move on each launch), times both over four layers' expert sets in one CUDA graph (so that
replays stream from memory), and reads when each block reaches each phase (%globaltimer, microseconds after the first
block's start: min, median and max over the blocks). `--copy-rate` also times bulk copies into shared memory alone
(bulk_rate) at a few copy sizes and depths. Needs a Hopper GPU; `python3 benchmarks/fp4_one_launch_specialised.py
--out results.json`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.result_file import report  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp4_one_launch_specialised.cu")
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp4_bulk_copies.cu")
LAYERS = 4
WARPS = 18  # 16 row warps, the tail warp, the producer warp
STAGES = 2
MAX_SHARED = 227 * 1024  # a Hopper block's dynamic shared memory at most
PHASES = ("start", "producer past its wait", "up groups issued", "up groups done", "tail stored",
          "activations loaded", "down rows done", "end")
COPY_SHAPES = ((4096, 4), (4096, 16), (12288, 4), (16384, 8), (32768, 4), (2048, 32))  # (bytes a copy, in flight)


def shared_bytes(hidden: int, inter: int, rows: int, choices: int, stages: int = STAGES) -> int:
    """fp4_experts_one_launch's dynamic shared memory, in the order the kernel lays it out: x's pairs, the ring, every
    choice's down codes and scale window, sums and factors [rows][choices], features [2][16], scratch [16], then the
    barriers (8-byte aligned): full and empty a stage, one a choice, two feature pairs."""
    stage = 16 * hidden // 2 + 16 * hidden // 16
    window = (rows * inter // 16 + 32 + 15) // 16 * 16
    n = 2 * hidden + stages * stage + choices * (rows * inter // 2 + window) + 4 * (2 * rows * choices + 32 + 16)
    return (n + 7) // 8 * 8 + 8 * (2 * stages + choices + 4)


def fitting_shared_bytes(hidden: int, inter: int, sms: int, choices: int) -> int:
    """shared_bytes for a grid of one block an SM, or ValueError where a block's share of the down rows does not fit."""
    rows = -(-hidden // sms)
    nbytes = shared_bytes(hidden, inter, rows, choices)
    if nbytes > MAX_SHARED:
        raise ValueError(f"fp4_experts_one_launch holds a block's {rows} down rows of {choices} choices in shared "
                         f"memory: {nbytes} bytes, more than a Hopper block's {MAX_SHARED} (hidden {hidden} over "
                         f"{sms} SMs)")
    return nbytes


def launch_arguments(x, experts, weights, ids, shared, flagged, state, out, stamps) -> list:
    """fp4_experts_one_launch's arguments in the order it declares them (cuda_probes.kernel_parameters)."""
    return [x.reshape(-1), experts.w13, experts.scale13, experts.row13, shared.up, shared.up_scale,
            shared.up_row_scale, experts.w2, experts.scale2, experts.row2, shared.down, shared.down_scale,
            shared.down_row_scale, weights, ids, experts.num_experts, experts.hidden, flagged, state, out, stamps]


class OneLaunch:
    """fp4_experts_one_launch for one device: its compiled kernels and the buffers it keeps between launches (the
    flagged activations and the launch counts start at zero and are only ever moved on by the kernel)."""

    def __init__(self, device: torch.device) -> None:
        from benchmarks.cuda_probes import probe_source

        self.device = device
        self.source = probe_source(os.path.basename(HELPERS), os.path.basename(SOURCE))
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.kernels: dict = {}
        self.buffers: dict = {}

    def _kernel(self, expression: str, threads: int, nbytes: int):
        from benchmarks.cuda_probes import compiled

        if expression not in self.kernels:
            kernel = compiled(self.source, os.path.basename(SOURCE), expression)
            if kernel.blocks_per_sm(threads, nbytes) < 1:
                raise RuntimeError(f"{expression}: no block fits an SM")
            self.kernels[expression] = kernel
        return self.kernels[expression]

    def __call__(self, x, experts, weights, ids, shared, down_after: int = 0, stamps=None) -> torch.Tensor:
        from shardserve.kernels.cuda import fp4_products as fp
        from shardserve.kernels.triton import pdl

        top_k, slots = ids.shape[-1], shared.slots
        hidden, inter, choices = experts.hidden, experts.inter, top_k + slots
        rows = -(-hidden // self.sms)
        nbytes = fitting_shared_bytes(hidden, inter, self.sms, choices)
        on = pdl.active(x.device)
        args = (hidden, inter, rows, STAGES, fp._dtype_code(x.dtype), int(on), fp.ACTIVATIONS[experts.activation],
                top_k, slots, int(ids.dtype == torch.int64), fp.WEIGHT_CODES[weights.dtype], down_after)
        kernel = self._kernel(f"fp4_experts_one_launch<{', '.join(str(a) for a in args)}>", 32 * WARPS, nbytes)
        key = (choices, inter)
        if key not in self.buffers:
            words = choices * 2 * (16 * (inter // 32) + inter // 16)
            self.buffers[key] = (torch.zeros(words, dtype=torch.int32, device=x.device),
                                 torch.zeros(2 + choices, dtype=torch.int32, device=x.device))
        flagged, state = self.buffers[key]
        out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
        kernel.launch((self.sms,), 32 * WARPS, launch_arguments(x, experts, weights, ids, shared, flagged, state, out,
                                                                stamps), pdl=on, shared_bytes=nbytes)
        return out


def phases(stamps: torch.Tensor, blocks: int) -> dict:
    t = stamps.view(blocks, len(PHASES)).cpu().double()
    since = (t - t[:, 0].min()) / 1000.0
    return {name: [round(float(since[:, i].min()), 2), round(float(since[:, i].median()), 2),
                   round(float(since[:, i].max()), 2)] for i, name in enumerate(PHASES)}


def copy_rates(one: OneLaunch) -> dict:
    """bulk_rate over 45 MB (a layer's experts) a launch, four launches a graph: us a launch and TB/s."""
    from benchmarks.moe_kernels import graph_time_us

    total = 45 << 20
    source = torch.empty(LAYERS * total, dtype=torch.uint8, device=one.device)
    sink = torch.zeros(1, dtype=torch.int32, device=one.device)
    rates = {}
    for size, depth in COPY_SHAPES:
        nbytes = size * depth + 8 * depth
        kernel = one._kernel(f"bulk_rate<{size}, {depth}>", 128, nbytes)
        per_block = total // one.sms // size * size

        def walk():
            for layer in range(LAYERS):
                kernel.launch((one.sms,), 128, [source[layer * total:], per_block, sink], shared_bytes=nbytes)

        us = graph_time_us(walk, 20, 3) / LAYERS
        rates[f"{size} B a copy, {depth} in flight"] = {"us": round(us, 2),
                                                        "TB/s": round(per_block * one.sms / us / 1e6, 2)}
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--copy-rate", action="store_true", help="also time bulk copies alone")
    args = p.parse_args()
    from benchmarks.fp4_cuda_anatomy import experts_us
    from benchmarks.moe_four_bit_one_token import one_token_experts
    from benchmarks.moe_kernels import graph_time_us
    from shardserve.kernels.cuda import fp4_products as fp

    device = torch.device("cuda")
    one = OneLaunch(device)
    layers = [one_token_experts("nemotron3-nano-30b-a3b", "fp4", 16, 2) for _ in range(LAYERS)]
    result = {"device": torch.cuda.get_device_name(), "SMs": one.sms}

    def two(x, e, w, i, sh):
        return fp.fp4_experts(x, e, w, i, sh, fp.EXPERT_TILES, x_early=True)

    x0, e0, w0, i0, sh0 = layers[0]
    left_out = i0.clone()
    left_out[0, 1] = -1
    for down_after in (0, 99):
        key = f"one launch, routed down rows copied after {down_after} up groups"
        same = all(torch.equal(one(*layer, down_after=down_after), two(*layer)) for layer in layers)
        same_left_out = torch.equal(one(x0, e0, w0, left_out, sh0, down_after), two(x0, e0, w0, left_out, sh0))
        us = [round(experts_us(layers, lambda *layer: one(*layer, down_after=down_after)), 2) for _ in range(2)]
        same_after = all(torch.equal(one(*layer, down_after=down_after), two(*layer)) for layer in layers)
        result[key] = {"us a layer": us, "same bits": same, "same bits, a choice left out": same_left_out,
                       "same bits after those launches": same_after}
        print(key, result[key], flush=True)
    stamps = torch.zeros(one.sms * len(PHASES), dtype=torch.int64, device=device)
    graph_time_us(lambda: [one(*layer, stamps=stamps if n == 2 else None) for n, layer in enumerate(layers)], 20, 2)
    torch.cuda.synchronize()
    result["phases of the third layer's launch, us (min, median, max over blocks)"] = phases(stamps, one.sms)
    result["two launches, us a layer"] = [round(experts_us(layers, two), 2) for _ in range(2)]
    if args.copy_rate:
        result["bulk copies alone"] = copy_rates(one)
    report(result, args.out, print_indent=1)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
