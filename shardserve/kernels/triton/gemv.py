"""Matrix-vector product for single-token decode: y = x @ W^T with W [N, K] row-major, x [1, K].

A decode step at batch 1 reads every weight once and does two FLOPs per weight, so it is bound by memory
bandwidth. Each program owns BLOCK_N output rows and walks their K columns in BLOCK_K tiles, keeping
float32 partial products in registers and reducing them once at the end, so one launch produces the
output (no split-K partials, no second reduction kernel). Weights are streamed with an evict-first hint
so they do not push the activations out of L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """K is a compile-time constant (one variant per layer shape): tiles need no column mask when it divides."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            x = tl.load(x_ptr + k + cols)
            w = tl.load(w_rows + k + cols[None, :], mask=row_ok[:, None], other=0.0,
                        eviction_policy="evict_first")
        else:
            col_ok = k + cols < K
            x = tl.load(x_ptr + k + cols, mask=col_ok, other=0.0)
            w = tl.load(w_rows + k + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 8, block_k: int = 512, num_warps: int = 4,
         num_stages: int = 3, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) times weight [N, K]^T -> [1, N] in x's dtype, float32 accumulation."""
    n, k = weight.shape
    if x.numel() != k or weight.stride(1) != 1:
        raise ValueError(f"gemv needs x with {k} elements and a row-major weight, got {tuple(x.shape)}")
    x = x.reshape(k)
    if not x.is_contiguous():
        x = x.contiguous()
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, out, n, weight.stride(0), K=k, BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
