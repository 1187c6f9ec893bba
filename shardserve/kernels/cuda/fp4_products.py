"""One token's products with 4-bit e2m1 weights in CUDA C (fp4_products.cu), for Hopper GPUs: the GEMV of an fp4
linear layer and a token's non-gated fp4 experts (NemotronH's), the shared expert's slots among them.

Against the Triton kernels they replace (kernels/triton/quant_gemv.py's split-K GEMV, kernels/triton/moe_four_bit.py)
a warp takes whole rows, so no program sums another's partial sums; in the expert launches every weight byte of a
warp's rows is loaded before the dependent-launch wait where its address is known by then (the GEMV's loads follow
its wait, first, before x's pairs: fp4_products.cu says why not before it); and x's float16 pairs are built once a
block, not once a program of a tile, or once a row where a norm comes before the GEMV (fp4_gemv_rmsnorm: the norm's
launch leaves them); the up product leaves the activations as float16 pairs for the down product, each 16 features
under a power of two of their own. Same float16 pair sums as theirs: 16-bit activations only. The
layouts: kernels/quant_pack.py's fp4 (codes uint8 [N, K / 2], an e4m3 byte a 16 columns [N, K / 16], a float32
scale a row [N]).
"""

from __future__ import annotations

import torch

from shardserve.kernels.cuda import runtime
from shardserve.kernels.packed_experts import PackedExperts
from shardserve.kernels.triton import pdl

SOURCE = "fp4_products.cu"
GROUP = 16
# (rows a warp, warps a block) of the GEMV that start-up times: the fastest of a sweep on an H200 at Nemotron-3-Nano's
# projections and their neighbours (10304 x 2688: 7.3 us against 10.05 for the split-K GEMV; 2688 x 4096: 4.15 against
# 5.34; 4608 x 2688: 4.2 against 6.3; benchmarks/results/fp4-cuda-kernels-nvidia-h200-20261130.json).
GEMV_CONFIGS = ((1, 4), (1, 8), (2, 4), (2, 8), (4, 4))
# x's float16 pairs sit in static shared memory (48 KB a block): 2 bytes a column.
SHARED_BYTES = 48 * 1024
# Threads of fp4_norm_pairs' one block.
NORM_THREADS = 512
ACTIVATIONS = {"relu2": 1, "silu": 2}
# (rows a warp, warps a block: a multiple of 16 features) of the up product; (warps a block, choices in flight a
# warp) of the down product: the fastest of a sweep on an H200 at Nemotron-3-Nano's NVFP4 experts with the shared
# expert's two slots, over four layers' experts, 21.8 us a layer (the up product 9.8) against 22.8 at (2, 8, 4, 3) and
# 27.9 for the Triton kernels (benchmarks/results/fp4-experts-x-early-nvidia-h200-20261130.json).
EXPERT_TILES = (2, 8, 2, 3)
# The experts' choice weights by dtype, as fp4_experts_down's WTS reads them.
WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _dtype_code(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 1, torch.float16: 0}[dtype]


def gemv_fits(n: int, k: int, group: int = GROUP) -> str | None:
    """Why fp4_gemv cannot take an [n, k] weight in groups of `group`, or None where it can."""
    if group != GROUP:
        return f"fp4_gemv reads groups of {GROUP} columns, not {group}"
    if k % 32 or k < 32:
        return f"fp4_gemv needs K a multiple of 32 (16-byte chunks of codes), got {k}"
    if 2 * k > SHARED_BYTES:
        return f"fp4_gemv holds x in shared memory: K at most {SHARED_BYTES // 2}, got {k}"
    if n < 1:
        return "fp4_gemv needs at least one row"
    return None


def _check_rows(name: str, codes: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor) -> None:
    n, k = codes.shape[-2], 2 * codes.shape[-1]
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape[-2:] != (n, k // GROUP):
        raise ValueError(f"{name} needs uint8 codes [.., N, K / 2] and uint8 scales [.., N, K / {GROUP}], got "
                         f"{codes.dtype} {tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if row_scale.dtype != torch.float32 or row_scale.shape != codes.shape[:-1]:
        raise ValueError(f"{name} needs float32 row scales {tuple(codes.shape[:-1])}, got {row_scale.dtype} "
                         f"{tuple(row_scale.shape)}")
    for what, t, align in (("codes", codes, 16), ("scales", scales, 2), ("row scales", row_scale, 4)):
        if not t.is_contiguous() or t.data_ptr() % align:
            raise ValueError(f"{name} needs {what} contiguous and {align}-byte aligned")


def _one_row(name: str, x: torch.Tensor, k: int) -> torch.Tensor:
    if x.numel() != k or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name} needs one row of {k} bfloat16 or float16 values, got {x.dtype} {tuple(x.shape)}")
    x = x.reshape(k).contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return x


def fp4_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor,
             rows: int = 2, warps: int = 4, next_early: bool = False) -> torch.Tensor:
    """x [1, K] (or [K]), bfloat16 or float16, times the fp4 weight transposed -> [1, N] in x's dtype. next_early:
    the next launch may be placed at this one's start (kernels/triton/pdl.py's early launches)."""
    _, k = _gemv_shape("fp4_gemv", codes, scales, row_scale)
    x = _one_row("fp4_gemv", x, k)
    return _gemv_launch(x, x.dtype, codes, scales, row_scale, rows, warps, next_early=next_early)


def fp4_gemv_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     codes: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor, rows: int = 2,
                     warps: int = 4, next_early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp4_gemv of RMSNorm(x + residual), x + residual) with the norm kernel's rounding
    (kernels/triton/gemv.normed_values); without a residual the sum is x itself. Two launches: the norm once, which
    leaves the normed row as the float16 pairs the GEMV reads (instead of every block of the GEMV making them), then
    the GEMV."""
    from shardserve.kernels.triton.gemv import normed_row_args

    _, k = _gemv_shape("fp4_gemv_rmsnorm", codes, scales, row_scale)
    x, residual, summed = normed_row_args(_one_row("fp4_gemv_rmsnorm", x, k), residual, norm_weight, k,
                                          "fp4_gemv_rmsnorm")
    if norm_weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise ValueError(f"fp4_gemv_rmsnorm needs x, the residual and the norm's weight of one dtype, got {x.dtype}, "
                         f"{None if residual is None else residual.dtype} and {norm_weight.dtype}")
    norm_weight = _one_row("fp4_gemv_rmsnorm", norm_weight, k)
    if residual is not None:
        residual = _one_row("fp4_gemv_rmsnorm", residual, k)
    on = pdl.active(x.device)
    pairs = torch.empty(k // 2, dtype=torch.int32, device=x.device)  # 4 * K / 32 chunks of 16 bytes
    exponent = torch.empty(1, dtype=torch.int32, device=x.device)
    norm = runtime.kernel(SOURCE, "fp4_norm_pairs", (k, NORM_THREADS, _dtype_code(x.dtype), on, residual is not None,
                                                     pdl.launches_next_early(x.device)), x.device)
    norm.launch((1,), NORM_THREADS, [x, x if residual is None else residual, norm_weight, float(eps), summed, pairs,
                                     exponent], pdl=on)
    return _gemv_launch(pairs, x.dtype, codes, scales, row_scale, rows, warps, exponent, next_early), summed


def _gemv_shape(name: str, codes: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor) -> tuple[int, int]:
    n, k = codes.shape[0], 2 * codes.shape[1]
    why = gemv_fits(n, k, 2 * codes.shape[1] // max(scales.shape[1], 1))
    if why:
        raise ValueError(why)
    _check_rows(name, codes, scales, row_scale)
    return n, k


def _gemv_launch(x: torch.Tensor, dtype: torch.dtype, codes: torch.Tensor, scales: torch.Tensor,
                 row_scale: torch.Tensor, rows: int, warps: int, exponent: torch.Tensor | None = None,
                 next_early: bool = False) -> torch.Tensor:
    """x: the row; or, with `exponent` (their power of two), the pairs fp4_norm_pairs left. dtype: the output's."""
    n, k = codes.shape[0], 2 * codes.shape[1]
    out = torch.empty(1, n, dtype=dtype, device=x.device)
    on = pdl.active(x.device)
    pairs = exponent is not None
    kernel = runtime.kernel(SOURCE, "fp4_gemv", (k, rows, warps, _dtype_code(dtype), on, pairs,
                                                 pdl.launches_next_early(x.device, next_early)), x.device)
    per_block = rows * warps
    kernel.launch(((n + per_block - 1) // per_block,), 32 * warps,
                  [x, codes, scales, row_scale, out, n, exponent if pairs else x], pdl=on)
    return out


def experts_fit(experts: PackedExperts, dtype: torch.dtype, choices: int) -> str | None:
    """Why fp4_experts cannot take these experts for a 16-bit token with `choices` choices (routed and slots), or
    None where it can."""
    if experts.kind != "fp4" or experts.activation not in ACTIVATIONS:
        return f"fp4_experts takes non-gated fp4 experts ({', '.join(ACTIVATIONS)}), not {experts.describe()}"
    if (experts.group13, experts.group2) != (GROUP, GROUP):
        return f"fp4_experts reads groups of {GROUP} columns, not {experts.group13} and {experts.group2}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"fp4_experts takes 16-bit tokens, not {dtype}"
    if experts.hidden % 32 or experts.inter % 32:
        return f"fp4_experts needs hidden and expert widths that are multiples of 32, got {experts.hidden} and " \
               f"{experts.inter}"
    if 2 * experts.hidden > SHARED_BYTES:
        return f"fp4_experts holds x in shared memory: a hidden width of at most {SHARED_BYTES // 2}"
    return None


def fp4_experts(x: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, ids: torch.Tensor,
                shared=None, tiles: tuple[int, int, int, int] = EXPERT_TILES, x_early: bool = False) -> torch.Tensor:
    """out [1, H] = sum_j weights[0, j] * w2[e_j] @ act(w13[e_j] @ x[0]) over ids [1, k] (choices outside [0, E) left
    out), plus the shared expert's slots (moe_four_bit.SharedSlots) with weight 1: two launches. x_early: x was
    written two or more launches before these (the router's kernels between), so the up launch reads it before its
    dependent-launch wait."""
    top_k = ids.shape[-1]
    slots = shared.slots if shared is not None else 0
    why = experts_fit(experts, x.dtype, top_k + slots)
    if why:
        raise ValueError(why)
    hidden, inter, num_experts = experts.hidden, experts.inter, experts.num_experts
    x = _one_row("fp4_experts", x, hidden)
    _check_rows("fp4_experts", experts.w13, experts.scale13, experts.row13)
    _check_rows("fp4_experts", experts.w2, experts.scale2, experts.row2)
    if shared is not None:
        _check_rows("fp4_experts", shared.up, shared.up_scale, shared.up_row_scale)
        if shared.down_row_scale is None or shared.down_row_scale.shape != (hidden,):
            raise ValueError("fp4_experts needs the shared expert's down row scales [H]")
        up, up_scale, up_rows = shared.up, shared.up_scale, shared.up_row_scale
        down, down_scale, down_rows = shared.down, shared.down_scale, shared.down_row_scale
    else:
        up, up_scale, up_rows = experts.w13, experts.scale13, experts.row13
        down, down_scale, down_rows = experts.w2, experts.scale2, experts.row2
    if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        raise ValueError(f"fp4_experts needs contiguous int32 or int64 choices, got {ids.dtype}")
    if weights.dtype not in WEIGHT_CODES or not weights.is_contiguous() or weights.numel() != top_k:
        raise ValueError(f"fp4_experts needs {top_k} contiguous float32 or 16-bit weights, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    up_rows_a_warp, up_warps, down_warps, depth = tiles
    if (up_rows_a_warp * up_warps) % GROUP:
        raise ValueError(f"fp4_experts tiles {tiles}: the up product's rows a block must be a multiple of {GROUP}")
    on, bf16, ids64 = pdl.active(x.device), _dtype_code(x.dtype), int(ids.dtype == torch.int64)
    # the activations as the down product reads them: float16 pairs (two bytes a feature) and a factor a group
    act = torch.empty(top_k + slots, inter // 2, dtype=torch.int32, device=x.device)
    unscales = torch.empty(top_k + slots, inter // GROUP, dtype=torch.float32, device=x.device)
    up_kernel = runtime.kernel(SOURCE, "fp4_experts_up", (hidden, inter, up_rows_a_warp, up_warps, bf16, on,
                                                          ACTIVATIONS[experts.activation], top_k, slots, ids64,
                                                          x_early), x.device)
    per_block = up_rows_a_warp * up_warps
    up_kernel.launch(((inter + per_block - 1) // per_block, slots + top_k), 32 * up_warps,
                     [x, experts.w13, experts.scale13, experts.row13, up, up_scale, up_rows, ids, num_experts, act,
                      unscales],
                     pdl=on)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    down_kernel = runtime.kernel(SOURCE, "fp4_experts_down", (inter, hidden, down_warps, depth, bf16, on, top_k, slots,
                                                              ids64, WEIGHT_CODES[weights.dtype]), x.device)
    down_kernel.launch(((hidden + down_warps - 1) // down_warps,), 32 * down_warps,
                       [act, unscales, experts.w2, experts.scale2, experts.row2, down, down_scale, down_rows, weights, ids,
                        num_experts, out], pdl=on)
    return out
