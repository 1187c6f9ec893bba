"""Batches through Llama-3-8B's projections with packed quantized weights: the fused Triton GEMMs of
shardserve/kernels/triton/quant_gemm.py against dequantizing the weight and cuBLAS (the path they replace) and
against a bfloat16 weight with cuBLAS. GPU only.

    python benchmarks/quant_gemm.py [--tp 2] [--rows 1,16,64] [--out results.json]

Weights: 4-bit GPTQ-style (groups of 128, scales and zero points) and FP8 scaled per row and 128-column block. Every
call is timed inside a CUDA graph, each on another copy of the weight (several times L2 in all), after the GEMM
was checked against dequantize + cuBLAS. For each GEMM every candidate tile of that row count is timed and the
fastest reported, with the default tile's time beside it. Prints microseconds, TFLOP/s and GB/s of weights
read per call; --out writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from shardserve.kernels.quant_pack import dequantize_fp8, dequantize_int4
from shardserve.kernels.triton.quant_gemm import candidate_configs, fp8_gemm, int4_gemm
from shardserve.layers.cuda_gemv import time_in_graph_us
from shardserve.layers.quantization.fp8 import quantize_fp8
from shardserve.layers.quantization.int4 import quantize_int4

GROUP = 128
ROWS = (1, 16, 64, 256, 512, 1024, 2048)
L2_BYTES = 400 * 2**20  # weights of one measurement in all: several times an H100's 50 MB of L2


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the weight [N, K] on one rank."""
    return {"qkv": (6144 // tp, 4096), "o": (4096, 4096 // tp), "gate_up": (28672 // tp, 4096),
            "down": (4096, 14336 // tp)}


def packed_copies(n: int, k: int) -> dict[str, list]:
    """For each format, enough copies of one random weight that together they overflow L2: dense bf16, int4
    (qweight, scale-and-zero words) and fp8 (weight, scale)."""
    dense = torch.randn(n, k, device="cuda") * k ** -0.5
    int4 = quantize_int4(dense, GROUP)
    fp8 = quantize_fp8(dense, GROUP)
    made = {"bf16": (dense.bfloat16(),), "int4": int4, "fp8": fp8}
    out = {}
    for name, parts in made.items():
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        out[name] = [tuple(p.clone() for p in parts) for _ in range(max(2, -(-L2_BYTES // nbytes)))]
    return out


def methods() -> dict[str, tuple]:
    """name -> (the format its weights are in, fn(x, weight parts, config) or fn(x, weight parts))."""
    return {
        "bf16_cublas": ("bf16", lambda x, w: F.linear(x, w[0])),
        "int4_dequant_cublas": ("int4", lambda x, w: F.linear(x, dequantize_int4(*w, GROUP, x.dtype))),
        "int4_gemm": ("int4", lambda x, w, c: int4_gemm(x, *w, GROUP, c)),
        "fp8_dequant_cublas": ("fp8", lambda x, w: F.linear(x, dequantize_fp8(*w, GROUP, x.dtype))),
        "fp8_gemm": ("fp8", lambda x, w, c: fp8_gemm(x, *w, GROUP, c)),
    }


def best_gemm(fn, weights: list, x: torch.Tensor, reference: torch.Tensor, what: str) -> dict:
    """Every candidate tile for x's rows, checked against the reference, then timed: the fastest and the default."""
    timed = {}
    for config in candidate_configs(x.shape[0]):
        got = fn(x, weights[0], config).float()
        error = ((got - reference).norm() / reference.norm()).item()
        if error > 2e-2:
            raise AssertionError(f"{what} with tiles {tuple(config)} is off by {error:.2g} against dequantize + cuBLAS")
        timed[tuple(config)] = time_in_graph_us(lambda x, w, c=config: fn(x, w, c), weights, x)
    best = min(timed, key=timed.get)
    default = tuple(candidate_configs(x.shape[0])[0])
    return {"us": timed[best], "tiles": list(best), "default_us": timed[default]}


def measure(n: int, k: int, rows: tuple[int, ...]) -> dict:
    copies = packed_copies(n, k)
    bytes_of = {name: sum(p.numel() * p.element_size() for p in parts[0]) for name, parts in copies.items()}
    results = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {}
        for name, (fmt, fn) in methods().items():
            if name.endswith("_gemm"):
                reference = methods()[f"{fmt}_dequant_cublas"][1](x, copies[fmt][0]).float()
                row[name] = best_gemm(fn, copies[fmt], x, reference, f"{name} {n}x{k} at {m} rows")
            else:
                row[name] = {"us": time_in_graph_us(fn, copies[fmt], x)}
            us = row[name]["us"]
            row[name].update(tflops=2 * m * n * k / us / 1e6, weight_gbps=bytes_of[fmt] / us / 1e3)
        results[m] = row
        print_row(n, k, m, row)
    del copies
    torch.cuda.empty_cache()
    return results


def print_row(n: int, k: int, m: int, row: dict) -> None:
    cells = []
    for name, r in row.items():
        cell = f"{name} {r['us']:8.1f} us {r['tflops']:6.1f} TF/s {r['weight_gbps']:6.0f} GB/s"
        if "tiles" in r:
            cell += f" {'x'.join(map(str, r['tiles'][:3]))}/{r['tiles'][3]}w/{r['tiles'][4]}s"
        cells.append(cell)
    speedups = (f"int4 gemm vs dequant {row['int4_dequant_cublas']['us'] / row['int4_gemm']['us']:.2f}x, "
                f"vs bf16 {row['bf16_cublas']['us'] / row['int4_gemm']['us']:.2f}x; "
                f"fp8 gemm vs dequant {row['fp8_dequant_cublas']['us'] / row['fp8_gemm']['us']:.2f}x, "
                f"vs bf16 {row['bf16_cublas']['us'] / row['fp8_gemm']['us']:.2f}x")
    print(f"[{n}x{k}] M={m:5d}  " + " | ".join(cells) + f"  ({speedups})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated batch sizes")
    p.add_argument("--out", help="write every figure as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quant_gemm.py times CUDA kernels: run it on a GPU")
    torch.manual_seed(0)
    rows = tuple(int(r) for r in args.rows.split(","))
    report = {"tp": args.tp, "device": torch.cuda.get_device_name(0), "group": GROUP, "shapes": {}}
    for name, (n, k) in shapes(args.tp).items():
        print(f"{name}: weight {n}x{k}", flush=True)
        report["shapes"][name] = {"shape": [n, k], "rows": measure(n, k, rows)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
