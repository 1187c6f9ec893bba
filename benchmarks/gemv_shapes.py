"""Batch-1 matrix-vector products of a Llama-3-8B layer, timed the way a decode step runs them: inside a
CUDA graph, each call on a different copy of the weight so nothing is served from L2.

    python benchmarks/gemv_shapes.py [--model qwen3-next-80b-a3b] [--tp 2] [--packed int4|fp8 [--grid]
                                     [--fp8-blocks]] [--sms N]

Methods: cuBLAS through F.linear, cuBLASLt through F.linear, torch.mm on a transposed weight, and the
Triton kernel of shardserve/kernels/triton/gemv.py over a grid of launch configurations. With --packed, the
packed GEMVs of shardserve/kernels/triton/quant_gemv.py instead (4-bit in groups of 128 with zero points, or
FP8 with a scale per row, or with --fp8-blocks in 128 x 128 blocks as block-scaled checkpoints hold them) over the
configurations the engine times at start-up (for 4-bit also the split-K
GEMV's, keys starting with "split", those with float16 sums ending in _1; for FP8 also the float16 sums', a fifth
element 1), checked against the dequantized product; with --grid (FP8) also over FP8_GRID, to find candidates for
another GPU. Prints us per call and GB/s of weights read (packed bytes and scales), and a RESULT line with every
figure.

--sms N times everything on N of the GPU's SMs (a CUDA green context): with fewer SMs each must issue for more
bytes a second, as on a GPU whose memory outruns its SMs (an H200 reads 4.8 TB/s with the 132 SMs an H100 has
for 3.35: 92 of an H100's SMs carry an H200's load per SM).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from shardserve.kernels.triton.gemv import gemv
from shardserve.layers import cuda_gemv

TRITON_CONFIGS = list(itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 4)))  # block_n, block_k, warps, stages
# Wider FP8 tiles than GEMV_CANDIDATES (a byte a weight: more columns for the same bytes in flight), up to 16 KiB
# of weights a program (beyond, the float32 products spill).
FP8_GRID = [(bn, bk, warps, 2) for bn, bk, warps in itertools.product((2, 4, 8), (2048, 4096), (4, 8))
            if bn * bk <= 16384] + [(16, 1024, 8, 2), (16, 2048, 8, 2)]


def shapes(tp: int, model: str = "llama-3-8b") -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the weight [N, K] on one rank: a Llama-3-8B layer's, or the packed projections of a
    Qwen3-Next-80B-A3B step (a DeltaNet layer's qkvz, ba and out, a gated attention layer's qkv and o)."""
    if model == "qwen3-next-80b-a3b":
        return {"qkvz": (12288 // tp, 2048), "ba": (64 // tp, 2048), "out": (2048, 4096 // tp),
                "attn_qkv": (9216 // tp, 2048), "attn_o": (2048, 4096 // tp)}
    return {"qkv": (6144 // tp, 4096), "o": (4096, 4096 // tp), "gate_up": (28672 // tp, 4096),
            "down": (4096, 14336 // tp), "lm_head": (128256 // tp, 4096)}


def cublaslt_linear(x, w):
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def packed_rows(kind: str, shape_list: dict[str, tuple[int, int]], grid: bool = False, fp8_blocks: bool = False
                ) -> dict:
    """The packed GEMVs over GEMV_CANDIDATES (and INT4_SPLIT_CANDIDATES for 4-bit; with `grid`, FP8_GRID for FP8),
    best per shape. fp8_blocks: FP8 in 128 x 128 blocks, the float16 sums' candidates limited as start-up limits
    them (rows of a program sharing their scales)."""
    from shardserve.kernels.quant_pack import dequantize_fp8, dequantize_int4
    from shardserve.kernels.triton.quant_gemv import (fp8_gemv, int4_gemv, int4_gemv_split, int4_split_sub,
                                                     rows_share_scales)
    from shardserve.layers.quantization.base import GEMV_CANDIDATES
    from shardserve.layers.quantization.fp8 import FP8_F16_CANDIDATES, quantize_fp8
    from shardserve.layers.quantization.int4 import INT4_SPLIT_CANDIDATES, quantize_int4

    group = 128
    results = {}
    for name, (n, k) in shape_list.items():
        dense = torch.randn(n, k, device="cuda") * k ** -0.5
        if kind == "int4":
            q, scale_zero = quantize_int4(dense, group)
            reference_w = dequantize_int4(q, scale_zero, group, torch.float32)
            parts = (q, scale_zero)
            launches = {"_".join(map(str, c)): lambda x, packed, c=c: int4_gemv(x, *packed, group, *c)
                        for c in GEMV_CANDIDATES}
            splits = [c for c in INT4_SPLIT_CANDIDATES if int4_split_sub(k, group, c[1])]
            launches.update({"split_" + "_".join(map(str, c)): lambda x, packed, c=c: int4_gemv_split(
                x, *packed, group, *c) for c in splits + [(*c, 1) for c in splits]})
        else:
            fp8_group = group if fp8_blocks else k
            q, scale = quantize_fp8(dense, fp8_group, block_rows=group if fp8_blocks else 1)
            reference_w = dequantize_fp8(q, scale, fp8_group, torch.float32)
            parts = (q, scale)
            f16 = [c for c in FP8_F16_CANDIDATES if not fp8_blocks or c[0] <= rows_share_scales(scale)]
            configs = dict.fromkeys([*GEMV_CANDIDATES, *f16, *(FP8_GRID if grid else ())])
            launches = {"_".join(map(str, c)): lambda x, packed, c=c: fp8_gemv(x, *packed, fp8_group, *c)
                        for c in configs}
        del dense
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        copies = max(2, -(-400 * 2**20 // nbytes))  # several times the L2 size in total
        packs = [parts] + [tuple(t.clone() for t in parts) for _ in range(copies - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        reference = x.float() @ reference_w.t()
        del reference_w
        row = {}
        for key, fn in launches.items():
            err = (fn(x, packs[0]).float() - reference).abs().max().item()
            if err > 0.02 * reference.abs().max().item():
                raise AssertionError(f"{kind} gemv wrong for {name} {key}: {err}")
            row[key] = time_in_graph_us(fn, packs, x)
        ranked = sorted((v, key) for key, v in row.items())
        print(f"{name:8s} [{n}x{k}] {kind} best " + ", ".join(
            f"{key} {v:.1f} us ({nbytes / v / 1e3:.0f} GB/s)" for v, key in ranked[:3]), flush=True)
        results[name] = {"shape": [n, k], "bytes": nbytes, "us": {key: round(v, 2) for key, v in row.items()}}
        del packs
        torch.cuda.empty_cache()
    return results


STREAM: torch.cuda.Stream | None = None  # --sms: the green context's stream
CONTEXT = None  # and the context itself, kept alive while its stream runs


def time_in_graph_us(fn, weights, x) -> float:
    return cuda_gemv.time_in_graph_us(fn, weights, x, stream=STREAM)


def use_sms(sms: int) -> torch.cuda.Stream:
    """Run every following kernel on `sms` of the GPU's SMs: a green context's stream made current (returned)."""
    global CONTEXT, STREAM
    from torch.cuda.green_contexts import GreenContext

    try:
        CONTEXT = GreenContext.create(num_sms=sms, device_id=0)
    except TypeError:  # torch before 2.12 takes them positionally
        CONTEXT = GreenContext.create(sms, 0)
    STREAM = CONTEXT.Stream()
    torch.cuda.set_stream(STREAM)
    return STREAM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("llama-3-8b", "qwen3-next-80b-a3b"), default="llama-3-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--packed", choices=("int4", "fp8"), default=None)
    p.add_argument("--grid", action="store_true", help="FP8: also time FP8_GRID's configurations")
    p.add_argument("--fp8-blocks", action="store_true", help="FP8 in 128 x 128 blocks (default: a scale a row)")
    p.add_argument("--only", default=None, help="comma-separated shape names (default: all)")
    p.add_argument("--sms", type=int, default=None, help="time on this many SMs (a CUDA green context)")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.sms:
        use_sms(args.sms)
    chosen = {name: shape for name, shape in shapes(args.tp, args.model).items()
              if args.only is None or name in args.only.split(",")}
    if args.packed:
        results = packed_rows(args.packed, chosen, args.grid, args.fp8_blocks)
        print("RESULT " + json.dumps({"model": args.model, "tp": args.tp, "device": torch.cuda.get_device_name(0),
                                      "sms": args.sms, "fp8_blocks": args.fp8_blocks,
                                      f"{args.packed}_gemv": results}))
        return
    results = {}
    for name, (n, k) in chosen.items():
        nbytes = n * k * 2
        copies = max(2, -(-400 * 2**20 // nbytes))  # several times the L2 size in total
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        row = {"cublas": time_in_graph_us(F.linear, weights, x),
               "cublaslt": time_in_graph_us(cublaslt_linear, weights, x)}
        transposed = [w.t().contiguous() for w in weights]
        row["mm_transposed"] = time_in_graph_us(torch.mm, transposed, x)
        del transposed
        reference = F.linear(x, weights[0]).float()
        for bn, bk, warps, stages in TRITON_CONFIGS:
            fn = lambda x, w: gemv(x, w, bn, bk, warps, stages)  # noqa: E731
            err = (fn(x, weights[0]).float() - reference).abs().max().item()
            if err > 0.05 * reference.abs().max().item():
                raise AssertionError(f"triton gemv wrong for {name} {bn}/{bk}/{warps}/{stages}: {err}")
            row[f"triton_{bn}_{bk}_{warps}_{stages}"] = time_in_graph_us(fn, weights, x)
        best_triton = min((v, key) for key, v in row.items() if key.startswith("triton"))
        print(f"{name:8s} [{n}x{k}] " + "  ".join(f"{key} {row[key]:.1f} us ({nbytes / row[key] / 1e3:.0f} GB/s)"
                                                for key in ("cublas", "cublaslt", "mm_transposed"))
              + f"  best {best_triton[1]} {best_triton[0]:.1f} us ({nbytes / best_triton[0] / 1e3:.0f} GB/s)",
              flush=True)
        results[name] = {"shape": [n, k], "bytes": nbytes, "us": {key: round(v, 2) for key, v in row.items()}}
        del weights
        torch.cuda.empty_cache()
    print("RESULT " + json.dumps({"tp": args.tp, "device": torch.cuda.get_device_name(0), "sms": args.sms,
                                  "gemv": results}))


if __name__ == "__main__":
    main()
