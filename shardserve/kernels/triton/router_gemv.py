"""A mixture-of-experts router's GEMV that also makes the router's choice, for a single token: one launch fewer a
layer at batch-1 decode.

The router's logits [1, E] come from the batch-1 GEMV (gemv.py): the norm-fused one on x + residual, or the plain
one where the input is already normed. The choice (softmax, top k, renormalisation: moe_router.route_token) would
be a one-warp launch of its own after it, a few microseconds of launch latency on each of a model's MoE layers.
Here the GEMV's programs count themselves in an arrival slot after storing their rows of logits
(arrivals.last_to_arrive), and the last to arrive, which then sees every row, loads the E logits past its L1 and
makes the choice, then puts the count back to 0.

The product is the GEMV kernel's own code, called inline with the configuration chosen for the router's shape, so
the logits, the new residual and the normed row are that kernel's bit for bit; the choice is route_token's on those
logits, whose results do not depend on the launch's warps (moe_router.py), so it is the separate launch's bit for
bit too. Dependent launch as every kernel of the chain: the products wait in the GEMV (pdl.enter), every program
counts itself after that wait, and the experts' kernels read the choice as they read the separate launch's (the
w13 product after its wait, the w2 product, two launches on, before its own: pdl.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.arrivals import arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.gemv import _gemv_kernel, _gemv_rmsnorm_kernel, _preload_arg, normed_row_args
from shardserve.kernels.triton.moe_router import route_token, routing_outputs

# The arrival count this kernel uses (any: the kernels that count leave their counts at 0).
ARRIVAL_SLOT = tl.constexpr(0)

Config = tuple[int, int, int, int]  # (block_n, block_k, num_warps, num_stages), as cuda_gemv's


@triton.jit
def _gemv_route_kernel(x_ptr, residual_ptr, norm_w_ptr, w_ptr, logits_ptr, sum_ptr, normed_ptr, weights_ptr, ids_ptr,
                       arrivals_ptr, N, stride_wn, eps,
                       K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, EXPERTS_P: tl.constexpr,
                       RENORMALIZE: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr = 0,
                       SHARED: tl.constexpr = False):
    """The N logits of x @ w^T as gemv._gemv_rmsnorm_kernel stores them with KEEP_NORMED (NORM: x + residual is
    normed on the fly, the sum and the normed row stored by program 0) or as gemv._gemv_kernel does (x already
    normed); then the last program to arrive routes the token on all N logits (route_token; weights float32 and
    ids to weights_ptr and ids_ptr) and leaves the slot at 0. SHARED: the last row is a folded shared expert's gate
    (route_token's SHARED), so the choice is over the first N - 1 logits and the shared expert is choice k + 1."""
    if NORM:
        _gemv_rmsnorm_kernel(x_ptr, residual_ptr, norm_w_ptr, w_ptr, logits_ptr, sum_ptr, normed_ptr, N, stride_wn,
                             eps, K=K, HAS_RESIDUAL=HAS_RESIDUAL, KEEP_NORMED=True, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K, PDL=PDL, PRELOAD=PRELOAD)
    else:
        _gemv_kernel(x_ptr, w_ptr, logits_ptr, N, stride_wn, K=K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PDL=PDL,
                     PRELOAD=PRELOAD)
    if last_to_arrive(arrivals_ptr, ARRIVAL_SLOT, tl.num_programs(0)):
        route_token(logits_ptr, weights_ptr, ids_ptr, 0, N - SHARED, 0, TOP_K, TOP_K_P, EXPERTS_P, RENORMALIZE,
                    LOGITS_FROM_L2=True, SHARED=SHARED)
        leave(arrivals_ptr, ARRIVAL_SLOT)


def gemv_rmsnorm_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, top_k: int, renormalize: bool, block_n: int = 8, block_k: int = 512,
                       num_warps: int = 4, num_stages: int = 3, shared: bool = False
                       ) -> tuple[torch.Tensor, ...] | None:
    """(logits, s, RMSNorm(s), weights, ids) in one launch: gemv.gemv_rmsnorm(..., keep_normed=True) of the router
    weight [E, K] and moe_router.route_top_k of its logits, bit for bit (`shared`: route_top_k's, the weight's last
    row a folded shared expert's gate). None where the device's arrival counts cannot be had (made first inside a
    CUDA graph capture)."""
    x, res, summed = normed_row_args(x, residual, norm_weight, weight.shape[1], "gemv_rmsnorm_route")
    normed = torch.empty_like(x)
    return _launch(x, res, norm_weight, eps, weight, summed, normed, top_k, renormalize,
                   (block_n, block_k, num_warps, num_stages), shared)


def gemv_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, block_n: int = 8,
               block_k: int = 512, num_warps: int = 4, num_stages: int = 3, shared: bool = False
               ) -> tuple[torch.Tensor, ...] | None:
    """(logits, weights, ids) in one launch for an input that is already normed: gemv.gemv of the router weight and
    route_top_k of its logits, bit for bit; None as gemv_rmsnorm_route."""
    k = weight.shape[1]
    if x.numel() != k:
        raise ValueError(f"gemv_route needs x with {k} elements, got {tuple(x.shape)}")
    out = _launch(x.reshape(k).contiguous(), None, None, 0.0, weight, None, None, top_k, renormalize,
                  (block_n, block_k, num_warps, num_stages), shared)
    return None if out is None else (out[0], *out[3:])


def _launch(x, residual, norm_weight, eps: float, weight: torch.Tensor, summed, normed, top_k: int,
            renormalize: bool, config: Config, shared: bool = False) -> tuple[torch.Tensor, ...] | None:
    """(logits, summed, normed, weights, ids) of one _gemv_route_kernel launch (NORM where norm_weight is given);
    None without arrival counts."""
    n, k = weight.shape
    if weight.stride(1) != 1:
        raise ValueError("the router's GEMV needs a row-major weight")
    counts = arrival_counts(weight.device, ARRIVAL_SLOT.value + 1)
    if counts is None:
        return None
    block_n, block_k, num_warps, num_stages = config
    logits, weights, ids = routing_outputs(torch.empty(1, n, dtype=x.dtype, device=x.device), top_k, shared)
    norm = norm_weight is not None
    _gemv_route_kernel[(triton.cdiv(n, block_n),)](
        x, x if residual is None else residual, norm_weight if norm else x, weight, logits,
        summed if norm else x, normed if norm else x, weights, ids, counts, n, weight.stride(0), eps,
        K=k, NORM=norm, HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, TOP_K=top_k,
        TOP_K_P=triton.next_power_of_2(top_k), EXPERTS_P=triton.next_power_of_2(n - shared), RENORMALIZE=renormalize,
        SHARED=shared,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(weight.device), **_preload_arg(k, block_k))
    return logits, summed, normed, weights, ids
