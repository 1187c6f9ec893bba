"""Where the 4-bit e2m1 kernels' time goes on a GPU: Nemotron-3-Nano's NVFP4 split-K GEMVs (the Mamba-2 in_proj,
10304 x 2688, and out_proj, 2688 x 4096) and one token's experts with the shared expert's two slots, timed as they
are and with parts of them taken out.

    python3 benchmarks/four_bit_anatomy.py [--variants as-is,no-math,...] [--out FILE]

Each variant runs in a process of its own, with a Triton cache of its own: it replaces module globals of the
kernels before anything compiles, so the kernels it times compute wrong values (timing only, nothing is checked).
- as-is: the kernels as they serve.
- one-and: each float16 pair of e2m1 codes made by one AND, not the two shifts and two masks it takes (what the
  cheapest conceivable decode would save).
- no-math: no decode and no multiply-adds: the loaded words folded by three XORs into each sum.
- x-loaded: x's float16 pairs and a scale a 16 columns read ready-made (one 16-byte load a word, from the bytes x
  itself occupies) instead of built in every program (x's load, its largest magnitude across the program, the
  conversions and the moves into the weights' layout).
- no-arrival: the GEMV's programs store their splits' partial sums and leave, without counting themselves in (an
  acquire-release atomic) for the last one to sum the splits.
- no-math+x-loaded, no-math+x-loaded+no-arrival: what the kernels' loads, scales and reductions take alone.

For each GEMV shape the best of start-up's split forms and fp4_split_sweep's grid (us and GB/s of codes and
scales); for the experts the default tiles (moe_four_bit_one_token's bytes). Prints one JSON object.
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import variant_runs  # noqa: E402

PARTS = ("one-and", "no-math", "x-loaded", "no-arrival")
VARIANTS = ("as-is", "one-and", "no-math", "x-loaded", "no-arrival", "no-math+x-loaded",
            "no-math+x-loaded+no-arrival")
GEMV_SHAPES = ((10304, 2688), (2688, 4096))
GROUP = 16


def parse_variants(value: str) -> list[str]:
    """--variants: names of VARIANTS, comma-separated."""
    return variant_runs.parse_variants(value, VARIANTS)


def _pair_sums_asm(words: list[str]) -> tl.constexpr:
    """_word_pair_sums' PTX for e2m1 codes with `words` in place of each word's decode (pairs a, b, c, d from $1,
    then from $2; multiply-adds as the kernel's)."""
    head = ["{", ".reg .b32 a, b, c, d, t;", ".reg .b16 lo, hi;", ".reg .f32 fl, fh;"]
    tail = ["mov.b32 {lo, hi}, t;", "cvt.f32.f16 fl, lo;", "cvt.f32.f16 fh, hi;", "add.f32 $0, fl, fh;", "}"]
    first = ["mul.rn.f16x2 t, a, $3;", "fma.rn.f16x2 t, b, $4, t;", "fma.rn.f16x2 t, c, $5, t;",
             "fma.rn.f16x2 t, d, $6, t;"]
    second = ["fma.rn.f16x2 t, a, $7, t;", "fma.rn.f16x2 t, b, $8, t;", "fma.rn.f16x2 t, c, $9, t;",
              "fma.rn.f16x2 t, d, $10, t;"]
    decode = [[line.replace("$w", w) for line in words] for w in ("$1", "$2")]
    return tl.constexpr("\n".join(head + decode[0] + first + decode[1] + second + tail))


ONE_AND = _pair_sums_asm(["and.b32 a, $w, 0x8E008E00;", "and.b32 b, $w, 0x0E8E0E8E;", "and.b32 c, $w, 0x8E0E8E0E;",
                          "and.b32 d, $w, 0x0E0E8E8E;"])
NO_MATH = tl.constexpr("\n".join(["{", ".reg .b32 t;", "xor.b32 t, $1, $2;", "xor.b32 t, t, $3;",
                                  "xor.b32 t, t, $7;", "mov.b32 $0, t;", "}"]))


@triton.jit
def _loaded_pairs(x_ptr, residual_ptr, norm_w_ptr, cols, rstd, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  FP4: tl.constexpr = False, LIMIT: tl.constexpr = 0):
    """quant_gemv._split_pairs' results read from x's own bytes as if they held them: four int32 pairs a word of
    8 columns (one 16-byte load), a float32 unscale a 16 columns."""
    words = x_ptr.to(tl.pointer_type(tl.int32))
    at = (cols // 8)[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    if LIMIT:
        v = tl.load(words + at, mask=(cols < LIMIT)[:, :, None], other=0)
    else:
        v = tl.load(words + at)
    even, odd = tl.split(v.reshape(cols.shape[0], cols.shape[1], 2, 2))
    x04, x26 = tl.split(even)
    x15, x37 = tl.split(odd)
    first = tl.max(cols, axis=1)
    scales = x_ptr.to(tl.pointer_type(tl.float32))
    if LIMIT:
        unscale = tl.load(scales + first // 16, mask=first < LIMIT, other=0.0)
    else:
        unscale = tl.load(scales + first // 16)
    return unscale, x04[:, None, :], x15[:, None, :], x26[:, None, :], x37[:, None, :], unscale[:, None]


@triton.jit
def _never_last(counts_ptr, slot, programs):
    """arrivals.last_to_arrive without its atomic: no program sums the splits."""
    return slot < 0


def patches() -> dict[str, list[tuple[object, str, object]]]:
    """Part -> the (module, global, replacement) it sets: the names the kernels look up when they compile."""
    from shardserve.kernels.triton import moe_four_bit, quant_gemv

    return {"one-and": [(quant_gemv, "_FP4_PAIR_SUMS_ASM", ONE_AND)],
            "no-math": [(quant_gemv, "_FP4_PAIR_SUMS_ASM", NO_MATH)],
            "x-loaded": [(quant_gemv, "_split_pairs", _loaded_pairs), (moe_four_bit, "_split_pairs", _loaded_pairs)],
            "no-arrival": [(quant_gemv, "last_to_arrive", _never_last)]}


def measure(variant: str) -> dict:
    """Apply the variant's parts, then time the GEMVs and the experts (this process's kernels are changed for good)."""
    import torch

    from benchmarks.fp4_split_sweep import grid, time_config, weights
    from benchmarks.moe_four_bit_one_token import experts_bytes, one_token_experts
    from benchmarks.moe_kernels import graph_time_us
    from shardserve.kernels.triton.moe_four_bit import FOUR_BIT_PAIR_TILES, one_token_four_bit_experts
    from shardserve.layers.quantization.int4 import split_forms

    for part in variant.split("+"):
        for module, name, value in patches().get(part, []):
            setattr(module, name, value)
    row = {}
    for n, k in GEMV_SHAPES:
        copies = weights(n, k, 8)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = copies[0][0].numel() + copies[0][1].numel() + 4 * n
        timed = []
        for config in sorted(set(grid(k)) | {tuple(f) for f in split_forms(k, GROUP) if len(f) == 5}):
            try:
                timed.append((time_config(config, copies, x), config))
            except Exception:  # noqa: BLE001 - a form the kernel refuses at this shape
                continue
        us, config = min(timed)
        row[f"{n}x{k}"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3), "config": config}
    x, experts, weights_, ids, shared = one_token_experts("nemotron3-nano-30b-a3b", "fp4", GROUP, 2)
    us = graph_time_us(lambda: one_token_four_bit_experts(x, experts, weights_, ids, FOUR_BIT_PAIR_TILES, shared),
                       100, 5)
    read = experts_bytes("nemotron3-nano-30b-a3b", "fp4", GROUP, 2)
    row["experts"] = {"us": round(us, 2), "GBps": round(read / us / 1e3)}
    return row


def _header() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name()}


def main() -> None:
    variant_runs.main(__doc__, VARIANTS, measure, __file__, _header, own_triton_cache=True)


if __name__ == "__main__":
    main()
