"""A token's fp4 experts in one launch with the down product cut along its K (fp4_experts_sliced.cu) against the two
launches of kernels/cuda/fp4_products.cu, at Nemotron-3-Nano's NVFP4 shapes (6 routed choices and the shared expert as
2 slots): relative error of each against float64, their difference, and us a layer over four layers' expert sets in
one CUDA graph (so that replays stream from memory), at a few ring depths; then probes, the kernel's source edited to
leave out the up product's arithmetic, the down product's, or both (timing only). Needs a Hopper GPU.
`python3 benchmarks/fp4_experts_sliced.py --out results.json`
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402

from benchmarks.result_file import report  # noqa: E402

SOURCES = ("fp4_bulk_copies.cu", "fp4_experts_sliced.cu")  # compiled after the package's fp4_products.cu
LAYERS = 4
THREADS = 512
GROUP = 16


class SlicedDown(NamedTuple):
    """The experts' down weights in groups' order, as fp4_experts_sliced streams them: codes [E, I / 16, H, 8] and
    scale bytes [E, I / 16, H] (the routed experts'), and the shared expert's [S * I / 16, H, 8] and [S * I / 16, H]."""
    codes: torch.Tensor
    scales: torch.Tensor
    shared_codes: torch.Tensor
    shared_scales: torch.Tensor


def sliced_down(experts, shared) -> SlicedDown:
    """The down weights of `experts` and of the shared expert's slots in fp4_experts_sliced's order: the same bytes,
    each 16 columns of every row side by side."""
    e, h, g = experts.num_experts, experts.hidden, experts.inter // GROUP
    groups = shared.down.shape[1] * 2 // GROUP
    return SlicedDown(experts.w2.view(e, h, g, GROUP // 2).permute(0, 2, 1, 3).contiguous(),
                      experts.scale2.permute(0, 2, 1).contiguous(),
                      shared.down.view(h, groups, GROUP // 2).permute(1, 0, 2).contiguous(),
                      shared.down_scale.permute(1, 0).contiguous())


def shared_bytes(hidden: int, stages: int) -> int:
    """The ring: a stage a group, its 16 up rows (codes, scale bytes, row scales) and its down columns (codes, scale
    bytes) of every hidden row."""
    return stages * (16 * hidden // 2 + 16 * hidden // 16 + 16 * 4 + 8 * hidden + hidden)


def launch_arguments(x, experts, weights, ids, shared, down: SlicedDown, sums, out, stamps=None) -> list:
    """fp4_experts_sliced's arguments in the order it declares them (cuda_probes.kernel_parameters)."""
    return [x, experts.w13, experts.scale13, experts.row13, shared.up, shared.up_scale, shared.up_row_scale,
            down.codes, down.scales, experts.row2, down.shared_codes, down.shared_scales, shared.down_row_scale,
            weights, ids, experts.num_experts, sums, out, stamps]


class Sliced:
    """fp4_experts_sliced for one device, compiled from its source with `edits` (probes), and its float32 sums (zero
    between launches: the last block leaves them so)."""

    def __init__(self, device: torch.device, edits: list[tuple[str, str]] = ()) -> None:
        from benchmarks.cuda_probes import probe_source

        self.source, self.sums = probe_source(*SOURCES, edits=edits), {}
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count

    def __call__(self, x, experts, weights, ids, shared, down: SlicedDown, stages: int, stamps=None) -> torch.Tensor:
        from benchmarks.cuda_probes import compiled
        from shardserve.kernels.cuda import fp4_products as fp
        from shardserve.kernels.triton import pdl

        on = pdl.active(x.device)
        args = (experts.hidden, experts.inter, stages, fp._dtype_code(x.dtype), int(on),
                fp.ACTIVATIONS[experts.activation], ids.shape[-1], shared.slots, int(ids.dtype == torch.int64),
                fp.WEIGHT_CODES[weights.dtype], 1)  # x written two launches back, as NemotronH's block runs them
        kernel = compiled(self.source, SOURCES[-1], f"fp4_experts_sliced<{', '.join(str(a) for a in args)}>")
        if experts.hidden not in self.sums:  # float32 sums, then the blocks' count
            self.sums[experts.hidden] = torch.zeros(experts.hidden + 4, dtype=torch.float32, device=x.device)
        out = torch.empty(1, experts.hidden, dtype=x.dtype, device=x.device)
        kernel.launch((self.sms,), THREADS, launch_arguments(
            x.reshape(-1), experts, weights, ids, shared, down, self.sums[experts.hidden], out, stamps), pdl=on,
            shared_bytes=shared_bytes(experts.hidden, stages))
        return out


def reference64(x, experts, weights, ids, shared) -> torch.Tensor:
    """The layer's output in float64 from the packed bytes' definitions (quant_pack.reference_weight64)."""
    from shardserve.kernels.quant_pack import reference_weight64

    def product(codes, scales, rows, v):
        return reference_weight64("fp4", codes, scales, 16, rows) @ v

    x64 = x.double().reshape(-1)
    out = torch.zeros_like(x64)
    for j, e in enumerate(ids.reshape(-1).tolist()):
        h = torch.relu(product(experts.w13[e], experts.scale13[e], experts.row13[e], x64)) ** 2
        out += float(weights.reshape(-1)[j]) * product(experts.w2[e], experts.scale2[e], experts.row2[e], h)
    if shared is not None:
        h = torch.relu(product(shared.up, shared.up_scale, shared.up_row_scale, x64)) ** 2
        out += product(shared.down, shared.down_scale, shared.down_row_scale, h)
    return out


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().reshape(-1) - want).norm() / want.norm())


STAMPS = 22  # points a block stamps (fp4_experts_sliced.cu's STAMPS)


def timeline(stamps: torch.Tensor, blocks: int) -> dict:
    """us after the first block's start at which the blocks reach each point: (min, median, max) over the blocks that
    reach it."""
    t = stamps.view(blocks, STAMPS).cpu().double()
    start = t[:, 0].min()
    names = ["start", "past the wait"] + [f"group {i // 2} {'in' if i % 2 == 0 else 'done'}" for i in range(18)] + [
        "adds issued", "end"]
    out = {}
    for k, name in enumerate(names):
        reached = t[:, k][t[:, k] > 0]
        if len(reached):
            since = (reached - start) / 1000.0
            out[name] = [round(float(since.min()), 2), round(float(since.median()), 2), round(float(since.max()), 2),
                         len(reached)]
    return out


# Probes: the kernel's source edited before it compiles, so that a part of its work is left out or done otherwise
# (timing only: the sums are not those of the experts). Each a list of (text, replacement).
NO_DOWN = [("const u32 pairs = word_products(q.y, a1, word_products(q.x, a0, 0u));",
            "const u32 pairs = q.x ^ q.y ^ a0.w0;")]
NO_UP = [("if (ch < Row<K>::CHUNKS) y += chunk_sum_held(codes[ch], scale_pairs[ch], xr[it]);",
          "if (ch < Row<K>::CHUNKS) y += __uint_as_float(codes[ch].w0 ^ scale_pairs[ch]);")]
NO_SMALL_COPIES = [  # a group's codes alone: its scale bytes and row scales not copied
    ("bar_expect(bar, STAGE);", "bar_expect(bar, UP_CODES + DOWN_CODES);"),
    ("bulk_copy(smem_addr(at + UP_CODES), (c < SLOTS ? shared_s13 : s13) + row * Row<K>::SCALES, UP_SCALES, bar);", ""),
    ("bulk_copy(smem_addr(at + UP_CODES + UP_SCALES), (c < SLOTS ? shared_rs13 : rs13) + row, UP_ROWS, bar);", ""),
    ("bulk_copy(smem_addr(at + DOWN_CODES), (c < SLOTS ? shared_s2 : s2) + group * K, DOWN_SCALES, bar);", "")]
EVICT_FIRST = [  # the bulk copies ask L2 to evict their lines first
    ('asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"\n'
     '                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");',
     'unsigned long long policy;\n'
     '    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));\n'
     '    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint '
     '[%0], [%1], %2, [%3], %4;"\n'
     '                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");')]
ONE_RANGE = [  # a block's groups read as one contiguous range of bytes (not the experts': timing only), two copies a group
    ("""        bulk_copy(smem_addr(at), (c < SLOTS ? shared_q13 : q13) + row * Row<K>::CHUNKS, UP_CODES, bar);""",
     """        const unsigned char* own = reinterpret_cast<const unsigned char*>(q13) + ((long)blockIdx.x * 8 + i) * STAGE;
        bulk_copy(smem_addr(at), own, STAGE / 2, bar);
        bulk_copy(smem_addr(at + STAGE / 2), own + STAGE / 2, STAGE / 2, bar);
        if (i >= 0) return;"""),
]
PROBES = {"no down arithmetic": NO_DOWN, "no up arithmetic": NO_UP, "no arithmetic": NO_UP + NO_DOWN,
          "no arithmetic, codes alone copied": NO_UP + NO_DOWN + NO_SMALL_COPIES,
          "no arithmetic, copies evicted first": NO_UP + NO_DOWN + EVICT_FIRST,
          "copies evicted first": EVICT_FIRST,
          "no arithmetic, a block's bytes one range": NO_UP + NO_DOWN + ONE_RANGE,
          "a block's bytes one range": ONE_RANGE}


def routed_us(layers, fns: dict) -> dict:
    """Each layer's router (Nemotron-3-Nano's: a float32 GEMV of 128 x H, then the grouped choice's kernel) before
    its experts, as a step runs them, the experts by each of `fns`: us a layer, in one CUDA graph over the layers."""
    from benchmarks.fp4_cuda_anatomy import experts_us
    from shardserve.config import GroupedTopK
    from shardserve.layers.grouped_topk import GroupedTopKRouter

    route = GroupedTopK(num_experts=layers[0][1].num_experts, top_k=layers[0][3].shape[-1], scaling_factor=2.5)
    routers = []
    for x, *_ in layers:
        router = GroupedTopKRouter(x.shape[-1], route).to(x.device)
        with torch.no_grad():
            router.weight.normal_(0, 0.02)
            router.e_score_correction_bias.normal_(0, 0.01)
        router(x)  # the device checks, outside the graph
        routers.append(router)
    by_x = {id(layer[0]): router for layer, router in zip(layers, routers)}
    out = {}
    for name, fn in fns.items():
        def step(x, e, w, i, sh, fn=fn):
            weights, ids = by_x[id(x)](x)
            return fn(x, e, weights, ids, sh)
        out[name] = round(experts_us(layers, step), 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="4,3,2")
    p.add_argument("--out")
    args = p.parse_args()
    from benchmarks.fp4_cuda_anatomy import experts_us
    from benchmarks.moe_four_bit_one_token import one_token_experts
    from shardserve.kernels.cuda import fp4_products as fp

    layers = [one_token_experts("nemotron3-nano-30b-a3b", "fp4", 16, 2) for _ in range(LAYERS)]
    downs = {id(layer[1]): sliced_down(layer[1], layer[4]) for layer in layers}
    result = {"device": torch.cuda.get_device_name()}
    plain = Sliced(torch.device("cuda"))

    def two(x, e, w, i, sh):
        return fp.fp4_experts(x, e, w, i, sh, fp.EXPERT_TILES, x_early=True)

    want = reference64(*layers[0])
    result["two launches: error against float64"] = error(two(*layers[0]), want)
    result["two launches, us a layer"] = [round(experts_us(layers, two), 2) for _ in range(2)]
    print(result, flush=True)
    for stages in [int(w) for w in args.stages.split(",")]:
        def sliced(x, e, w, i, sh, stages=stages):
            return plain(x, e, w, i, sh, downs[id(e)], stages)

        got = sliced(*layers[0])
        again = [sliced(*layers[0]) for _ in range(20)]
        left_out = layers[0][3].clone()
        left_out[0, 1] = -1
        row = {"error against float64": error(got, want),
               "against the two launches": error(got, two(*layers[0]).double().reshape(-1)),
               "equal bits over 20 launches": sum(torch.equal(a, got) for a in again),
               "a choice left out, against the two launches":
                   error(sliced(layers[0][0], layers[0][1], layers[0][2], left_out, layers[0][4]),
                         two(layers[0][0], layers[0][1], layers[0][2], left_out, layers[0][4]).double().reshape(-1)),
               "us a layer": [round(experts_us(layers, sliced), 2) for _ in range(2)]}
        result[f"sliced, {stages} stages"] = row
        print(stages, row, flush=True)
    from benchmarks.moe_kernels import graph_time_us

    for stages in [int(w) for w in args.stages.split(",")]:
        stamps = torch.zeros(plain.sms * STAMPS, dtype=torch.int64, device="cuda")
        graph_time_us(lambda: [plain(*layer, downs[id(layer[1])], stages, stamps=stamps if n == 2 else None)
                               for n, layer in enumerate(layers)], 20, 2)
        torch.cuda.synchronize()
        result[f"timeline of the third layer's launch, {stages} stages: us (min, median, max, blocks)"] = \
            timeline(stamps, plain.sms)
        print(stages, timeline(stamps, plain.sms), flush=True)
    for name, edits in PROBES.items():
        probe = Sliced(torch.device("cuda"), edits)
        for stages in [int(w) for w in args.stages.split(",")]:
            us = experts_us(layers, lambda x, e, w, i, sh, stages=stages: probe(x, e, w, i, sh, downs[id(e)], stages))
            result[f"probe: {name}, {stages} stages, us a layer"] = round(us, 2)
            print(name, stages, round(us, 2), flush=True)
    result["two launches again, us a layer"] = [round(experts_us(layers, two), 2) for _ in range(2)]
    result["with each layer's router before it, us a layer"] = routed_us(layers, {
        "two launches": two,
        **{f"sliced, {st} stages": (lambda x, e, w, i, sh, st=st: plain(x, e, w, i, sh, downs[id(e)], st))
           for st in [int(w) for w in args.stages.split(",")]}})
    print(result["with each layer's router before it, us a layer"], flush=True)
    report(result, args.out, print_indent=1)


if __name__ == "__main__":
    main()
