"""Where the CUDA C fp4 kernels' time goes (kernels/cuda/fp4_products.cu), at Nemotron-3-Nano's NVFP4 shapes on one
GPU: the GEMVs of in_proj (10304 x 2688), out_proj (2688 x 4096) and q|k|v (4608 x 2688), and one token's experts
with the shared expert's two slots, timed as they are and with parts of them changed or taken out.

    python3 benchmarks/fp4_cuda_anatomy.py [--variants as-is,one-mask,...] [--out FILE]

Each variant runs in a process of its own and edits the kernels' source text before anything compiles (the
runtime compiles fp4_products.cu from the text it reads), so a timing-only variant computes wrong values; the
others report their error against float64.
- as-is: the kernels as they serve.
- one-mask: a word's four float16 pairs from one mask, not two shifts and two masks a pair (timing only: what a
  decode that cost nothing would save).
- rotations: the decode of a layout repacked so that a word takes five rotations and six masks, the fewest
  instructions of any bit placement (15 a word against 19, multiply-adds included; timing only).
- f16-scales: in the GEMV and the up launch, a chunk's two group scales applied to its pair sums in float16 pairs
  (one conversion to float32 a chunk, not two).
- no-act-loads: the down launch without its loads of the activations (timing only).
- one-mask+no-act-loads: the two launches' floor.
- one-launch-floor: fp4_one_launch_floor.cu in place of the experts' two launches: the same bytes read in one
  launch with a barrier over the grid, no arithmetic (timing only).
GEMVs at (rows a warp, warps a block) (1, 4), (1, 8) and (4, 4) over 8 weight copies (cuda_gemv.time_in_graph_us);
the experts over four layers' sets (so that replays stream from memory), with the up launch alone beside them.
Prints one JSON object.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import variant_runs  # noqa: E402

VARIANTS = ("as-is", "one-mask", "rotations", "f16-scales", "no-act-loads", "one-mask+no-act-loads",
            "one-launch-floor")
GEMV_SHAPES = ((10304, 2688), (2688, 4096), (4608, 2688))
GEMV_CONFIGS = ((1, 4), (1, 8), (4, 4))
LAYERS = 4  # expert sets a timed graph walks through
FLOOR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp4_one_launch_floor.cu")
FLOOR_SHAPES = ((8, 1), (4, 1), (8, 2))  # (warps a block, up rows a warp at a time)

_WORD = """    acc = fma2(e2m1_pair<0>(q), x.w0, acc);
    acc = fma2(e2m1_pair<1>(q), x.w1, acc);
    acc = fma2(e2m1_pair<2>(q), x.w2, acc);
    return fma2(e2m1_pair<3>(q), x.w3, acc);"""
_ROW_SUM = "y[r] += chunk_sum<Row<K>::CHUNKS>(w[r][it], scales[r][it], xs, c);"  # the GEMV's and the up launch's
_DOWN_SUM = """                    const float2 u = uj[c];
                    t += chunk_sum<Row<K>::CHUNKS>(w[j % DEPTH][it], scales[j % DEPTH][it], xj, c, u.x, u.y);"""
_DOWN_LOOP = "    float total = 0.0f;\n#pragma unroll\n    for (int j = 0; j < CHOICES; ++j) {"
_FMA2 = "static __device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {"
_AFTER_CHUNK_SUM = "// The power of two 2^e"
# part -> (text of fp4_products.cu, its replacement), each text found exactly once
EDITS = {
    "one-mask": [(_WORD, """    acc = fma2(q & 0x8E008E00u, x.w0, acc);
    acc = fma2(q, x.w1, acc);
    acc = fma2(q, x.w2, acc);
    return fma2(q, x.w3, acc);""")],
    "rotations": [(_WORD, """    const u32 r9 = __funnelshift_l(q, q, 9), r11 = __funnelshift_l(q, q, 11);
    const u32 r3 = __funnelshift_l(q, q, 3), r10 = __funnelshift_l(q, q, 10), r28 = __funnelshift_l(q, q, 28);
    acc = fma2((r9 & 0x0E000E00u) | (r11 & 0x80008000u), x.w0, acc);
    acc = fma2(r3 & 0x8E008E00u, x.w1, acc);
    acc = fma2((q & 0x0E000E00u) | (r10 & 0x80008000u), x.w2, acc);
    return fma2(r28 & 0x8E008E00u, x.w3, acc);""")],
    "f16-scales": [
        (_FMA2, """static __device__ __forceinline__ u32 mul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

""" + _FMA2),
        (_AFTER_CHUNK_SUM, """// chunk_sum, its groups' scales applied in float16 pairs: one conversion a chunk.
template <int CHUNKS>
static __device__ __forceinline__ float chunk_sum_f16(Chunk w, u32 scales, const Chunk* xs, int c) {
    const Chunk x0 = xs[c], x1 = xs[CHUNKS + c], x2 = xs[2 * CHUNKS + c], x3 = xs[3 * CHUNKS + c];
    const u32 a = word_products(w.w1, x1, word_products(w.w0, x0, 0u));
    const u32 b = word_products(w.w3, x3, word_products(w.w2, x2, 0u));
    const u32 sa = __byte_perm(scales, 0, 0x4040) << 7, sb = __byte_perm(scales, 0, 0x4141) << 7;
    return pair_sum(fma2(b, sb, mul2(a, sa)));
}

""" + _AFTER_CHUNK_SUM),
        (_ROW_SUM, _ROW_SUM.replace("chunk_sum<", "chunk_sum_f16<"))],
    "no-act-loads": [
        (_DOWN_LOOP, _DOWN_LOOP.replace("\n#pragma", "\n    const Chunk held = act[lane];  // loaded once\n#pragma")),
        (_DOWN_SUM, "                    t += chunk_sum_held(w[j % DEPTH][it], scales[j % DEPTH][it], held);"),
        (_AFTER_CHUNK_SUM, """static __device__ __forceinline__ float chunk_sum_held(Chunk w, u32 scales, Chunk x) {
    const u32 a = word_products(w.w1, x, word_products(w.w0, x, 0u));
    const u32 b = word_products(w.w3, x, word_products(w.w2, x, 0u));
    return pair_sum(a) * e4m3_units(scales & 0xFF) + pair_sum(b) * e4m3_units(scales >> 8);
}

""" + _AFTER_CHUNK_SUM)],
}
PARTS = tuple(EDITS) + ("one-launch-floor",)


def parse_variants(value: str) -> list[str]:
    """--variants: names of VARIANTS, comma-separated."""
    return variant_runs.parse_variants(value, VARIANTS)


def edited_source(variant: str, source: str) -> str:
    """fp4_products.cu's text with the variant's edits; ValueError where a text to replace is not there once."""
    for part in variant.split("+"):
        for old, new in EDITS.get(part, []):
            if source.count(old) != 1:
                raise ValueError(f"{part}: fp4_products.cu has {source.count(old)} copies of {old[:60]!r}")
            source = source.replace(old, new)
    return source


def experts_us(layers, fn) -> float:
    """fn(*layer) for each layer in one CUDA graph, timed; us a layer."""
    from benchmarks.moe_kernels import graph_time_us

    def walk():
        for layer in layers:
            fn(*layer)
    return graph_time_us(walk, 50, 5) / len(layers)


def _floor_rows(layers) -> dict:
    """fp4_one_launch_floor at each of FLOOR_SHAPES, as many blocks an SM as fit; us a layer."""
    import torch

    from benchmarks.cuda_probes import compiled, probe_source
    from shardserve.kernels.triton import pdl

    source = probe_source(os.path.basename(FLOOR_SOURCE))  # the probe uses the kernels' helpers
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    _, experts, _, ids, shared = layers[0]
    top_k, slots = ids.shape[-1], shared.slots
    rows = {}
    for warps, up_rows in FLOOR_SHAPES:
        expression = (f"one_launch_floor<{experts.hidden}, {experts.inter}, {top_k}, {slots}, {warps}, "
                      f"{up_rows}>")
        kernel = compiled(source, os.path.basename(FLOOR_SOURCE), expression)
        fits = kernel.blocks_per_sm(32 * warps)
        grid = sms * fits  # every block placed at once: each waits at the barrier for all
        barrier = torch.zeros(1, dtype=torch.int32, device=device)
        act = torch.empty((top_k + slots) * experts.inter, dtype=torch.float32, device=device)
        out = torch.empty(experts.hidden, dtype=torch.int16, device=device)

        def one(x, e, w, i, sh):
            kernel.launch((grid,), 32 * warps, [e.w13, sh.up, e.w2, sh.down, i, act, out, barrier],
                          pdl=pdl.active(device))

        rows[f"{warps} warps a block, {up_rows} up rows a warp, {fits} blocks an SM"] = round(
            experts_us(layers, one), 2)
    return rows


def measure(variant: str) -> dict:
    """Edit the kernels' source as the variant says, then time the GEMVs and the experts."""
    import torch

    from benchmarks.fp4_split_sweep import GROUP, weights
    from benchmarks.moe_four_bit_one_token import one_token_experts
    from shardserve.kernels.cuda import fp4_products, runtime
    from shardserve.kernels.quant_pack import reference_weight64
    from shardserve.layers.cuda_gemv import time_in_graph_us

    with open(os.path.join(os.path.dirname(os.path.abspath(fp4_products.__file__)), fp4_products.SOURCE)) as f:
        text = edited_source(variant, f.read())
    read = runtime._source
    runtime._source = lambda filename: text if filename == fp4_products.SOURCE else read(filename)
    row = {}
    for n, k in GEMV_SHAPES:
        copies = weights(n, k, 8)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = x.double() @ reference_weight64("fp4", *copies[0][:2], GROUP, copies[0][2]).T
        for config in GEMV_CONFIGS:
            got = fp4_products.fp4_gemv(x, *copies[0], *config)
            us = time_in_graph_us(lambda x, c: fp4_products.fp4_gemv(x, *c, *config), copies, x, replays=20)
            row[f"{n}x{k} {config}"] = {"us": round(us, 2),
                                        "error": float((got.double() - want).norm() / want.norm())}
    layers = [one_token_experts("nemotron3-nano-30b-a3b", "fp4", GROUP, 2) for _ in range(LAYERS)]
    if variant == "one-launch-floor":
        row["experts, one launch"] = _floor_rows(layers)
        return row

    def experts(x, e, w, i, sh):
        fp4_products.fp4_experts(x, e, w, i, sh, fp4_products.EXPERT_TILES, x_early=True)

    row["experts"] = round(experts_us(layers, experts), 2)
    launch = runtime.Kernel.launch
    try:  # the up launch alone: the down launch skipped
        runtime.Kernel.launch = lambda self, *a, **kw: None if "down" in self.name else launch(self, *a, **kw)
        row["up launch"] = round(experts_us(layers, experts), 2)
    finally:
        runtime.Kernel.launch = launch
    return row


def _header() -> dict:
    import torch

    from shardserve.kernels.cuda.fp4_products import EXPERT_TILES

    return {"device": torch.cuda.get_device_name(), "experts tiles": EXPERT_TILES}


def main() -> None:
    variant_runs.main(__doc__, VARIANTS, measure, __file__, _header)


if __name__ == "__main__":
    main()
