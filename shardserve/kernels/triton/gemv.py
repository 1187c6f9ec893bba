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

from shardserve import envs
from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.pdl import enter


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, PRELOAD: tl.constexpr = 0, SWIGLU_OUT: tl.constexpr = False):
    """K is a compile-time constant (one variant per layer shape): tiles need no column mask when it divides.
    PDL: launched to overlap the kernel before it (pdl.py). PRELOAD (0 to the row's tiles; SHARDSERVE_GEMV_PRELOAD
    says 0 to 2, and the o projection may take all: pdl.py): that many weight tiles are loaded before that wait
    (no kernel of the chain writes weights), so programs placed early stream weights while the kernel before them
    (an all-reduce, attention) still runs.
    SWIGLU_OUT: the weight is [gate | up] (2N rows) and the output silu(gate) * up (N values; program_rows)."""
    rows, row_ok = program_rows(tl.program_id(0), N, BLOCK_N, SWIGLU_OUT)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    preloaded = load_first_tiles(w_rows, cols, row_ok, K, BLOCK_K, PRELOAD)
    enter(PDL)
    y = row_dots(preloaded, w_rows, x_ptr, cols, row_ok, K, BLOCK_N, BLOCK_K, PRELOAD)
    store_rows(out_ptr, y, rows, row_ok, tl.program_id(0), N, BLOCK_N, SWIGLU_OUT)


@triton.jit
def program_rows(pid, N, BLOCK_N: tl.constexpr, SWIGLU_OUT: tl.constexpr):
    """(the weight rows program `pid` multiplies, which of them exist): BLOCK_N consecutive rows of N; with
    SWIGLU_OUT, BLOCK_N / 2 features of N, each as its gate row f and up row N + f side by side (row 2i of the
    block is feature i's gate, row 2i + 1 its up), so one program has both halves of its outputs."""
    if SWIGLU_OUT:
        j = tl.arange(0, BLOCK_N)
        features = pid * (BLOCK_N // 2) + j // 2
        rows = features + (j % 2) * N
        row_ok = features < N
    else:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
    return rows, row_ok


@triton.jit
def store_rows(out_ptr, y, rows, row_ok, pid, N, BLOCK_N: tl.constexpr, SWIGLU_OUT: tl.constexpr):
    """Store a program's row products y [BLOCK_N] (float32) in out's dtype; with SWIGLU_OUT (program_rows'
    order) silu(gate) * up of its BLOCK_N / 2 features, rounded as fused_ops._silu_and_mul_kernel rounds the
    stored gate and up values, so the output equals the GEMV followed by that kernel bit for bit."""
    if SWIGLU_OUT:
        gate, up = tl.split(tl.reshape(y.to(out_ptr.dtype.element_ty), (BLOCK_N // 2, 2)))
        g = gate.to(tl.float32)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        features = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + features, out, mask=features < N)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def load_first_tiles(w_rows, cols, row_ok, K: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr):
    """The first PRELOAD weight tiles of the rows, as a tuple: loaded before a dependent-launch wait, since no
    kernel of a decode chain writes weights."""
    preloaded = ()
    for t in tl.static_range(PRELOAD):
        preloaded = preloaded + (_weight_tile(w_rows, t * BLOCK_K, cols, row_ok, K, BLOCK_K),)
    return preloaded


@triton.jit
def row_dots(preloaded, w_rows, x_ptr, cols, row_ok, K: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr):
    """[BLOCK_N] float32: each row's dot product with x over K, the preloaded tiles first (load_first_tiles), then
    the rest tile by tile; float32 partial products in registers, reduced once."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t in tl.static_range(PRELOAD):
        acc += preloaded[t].to(tl.float32) * _x_tile(x_ptr, t * BLOCK_K, cols, K, BLOCK_K).to(tl.float32)[None, :]
    for k in range(PRELOAD * BLOCK_K, K, BLOCK_K):
        w = _weight_tile(w_rows, k, cols, row_ok, K, BLOCK_K)
        acc += w.to(tl.float32) * _x_tile(x_ptr, k, cols, K, BLOCK_K).to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _weight_tile(w_rows, k, cols, row_ok, K: tl.constexpr, BLOCK_K: tl.constexpr):
    if K % BLOCK_K == 0:
        w = tl.load(w_rows + k + cols[None, :], mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + k + cols[None, :], mask=row_ok[:, None] & (k + cols < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _x_tile(x_ptr, k, cols, K: tl.constexpr, BLOCK_K: tl.constexpr):
    if K % BLOCK_K == 0:
        x = tl.load(x_ptr + k + cols)
    else:
        x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0)
    return x


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 8, block_k: int = 512, num_warps: int = 4,
         num_stages: int = 3, preload: int | None = None, swiglu_out: bool = False) -> torch.Tensor:
    """x [1, K] (or [K]) times weight [N, K]^T -> [1, N] in x's dtype, float32 accumulation. With `swiglu_out`
    the weight is a [gate | up] projection and the result silu(gate) * up, [1, N / 2], in the same launch.
    `preload`: weight tiles each program loads before its dependent-launch wait (None: preload_tiles(); at most
    the row's tiles, row_tiles(K, block_k) for all of them); the same bits whatever it is."""
    return _launch_per_row(_gemv_kernel, _one_row(x, weight, 1, "gemv needs x with {} elements"), weight,
                           block_n, block_k, num_warps, num_stages, swiglu_out, preload)


def gemv_float32_out(x: torch.Tensor, weight: torch.Tensor, block_n: int = 1, block_k: int = 512,
                     preload: int | None = None) -> torch.Tensor:
    """gemv's products into float32 logits [1, N] whatever x's dtype (a router: a float32 weight, x 16-bit).
    preload: weight tiles a program loads before the dependent-launch wait (preload_tiles() unless given; at most a
    row's tiles)."""
    return _launch_per_row(_gemv_kernel, _one_row(x, weight, 1, "gemv needs x with {} elements"), weight, block_n,
                           block_k, 4, 3, preload=preload, out_dtype=torch.float32)


def _one_row(x: torch.Tensor, weight: torch.Tensor, per_column: int, needs: str) -> torch.Tensor:
    """x flattened to per_column * K contiguous values for weight [N, K], which must be row-major; `needs`
    words the error, with {} for the number of values."""
    k = weight.shape[1]
    if x.numel() != per_column * k or weight.stride(1) != 1:
        raise ValueError(f"{needs.format(per_column * k)} and a row-major weight, got {tuple(x.shape)}")
    return x.reshape(per_column * k).contiguous()


def _launch_per_row(kernel, x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, num_warps: int,
                    num_stages: int, swiglu_out: bool = False, preload: int | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Run a one-row GEMV kernel (signature x, w, out, N, stride_wn, K=..) over block_n rows of weight a program
    (with `swiglu_out`, _gemv_kernel's SWIGLU_OUT form: block_n / 2 features of silu(gate) * up a program)."""
    k = weight.shape[1]
    extra = {}
    if kernel is _gemv_kernel:
        extra = _preload_arg(k, block_k, preload)
    n, programs = output_rows(weight, block_n, swiglu_out)
    if swiglu_out:
        extra["SWIGLU_OUT"] = True
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    kernel[(programs,)](x, weight, out, n, weight.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=block_k,
                        num_warps=num_warps, num_stages=num_stages, **pdl.launch(weight.device), **extra)
    return out


def output_rows(weight: torch.Tensor, block_n: int, swiglu_out: bool) -> tuple[int, int]:
    """(N, programs) of a one-row GEMV launch over block_n weight rows a program: N the weight's rows, or with
    `swiglu_out` the features of a [gate | up] weight (half its rows, block_n / 2 a program: each program takes
    a feature's gate and up rows together, so both must be even)."""
    rows = weight.shape[0]
    if not swiglu_out:
        return rows, triton.cdiv(rows, block_n)
    if rows % 2 or block_n % 2:
        raise ValueError(f"a SwiGLU-out GEMV needs an even number of weight rows and block_n, got {rows} rows and "
                         f"block_n {block_n}")
    return rows // 2, triton.cdiv(rows // 2, block_n // 2)


def row_tiles(k: int, block_k: int) -> int:
    """Tiles of block_k columns in a row of k."""
    return triton.cdiv(k, block_k)


def _preload_arg(k: int, block_k: int, preload: int | None = None) -> dict:
    """The PRELOAD argument of a launch over K = k columns: `preload` tiles where given (at most the row's);
    else preload_tiles(), at most 1 where k has fewer than that many tiles; none at 0 (the kernels' default)."""
    if preload is not None:
        return {"PRELOAD": min(preload, row_tiles(k, block_k))}
    tiles = preload_tiles()
    return {"PRELOAD": tiles if k >= tiles * block_k else 1} if tiles else {}


PRELOAD_ENV = envs.GEMV_PRELOAD.name


def preload_tiles() -> int:
    """How many weight tiles the batch-1 GEMVs (plain and norm-fused) load before waiting for the kernel before it
    (SHARDSERVE_GEMV_PRELOAD, 0 to 2, default 1; it matters only with dependent launch). On two H100s one tile
    took the Llama-3-8B-shaped TP=2 batch-1 graph from 3.096 to 3.049 ms, two 3.060; TP=1 5.322 -> 5.329 ms
    with two."""
    return int(envs.GEMV_PRELOAD.get())


@triton.jit
def _gemv_swiglu_kernel(gate_up_ptr, w_ptr, out_ptr, N, stride_wn,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    """As _gemv_kernel with x = silu(gate) * up computed on the fly from gate_up = [gate | up] (2K values)
    (swiglu_dots)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    enter(PDL)
    y = swiglu_dots(w_rows, gate_up_ptr, cols, row_ok, K, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def swiglu_dots(w_rows, gate_up_ptr, cols, row_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] float32: each row's dot product with x = silu(gate) * up over K, x rounded as
    shardserve.kernels.triton.fused_ops.silu_and_mul rounds, so the products equal the two-kernel path's. Every
    program recomputes the activation of its K columns: cheap next to streaming the weights."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        col_ok = k + cols < K
        gate = tl.load(gate_up_ptr + k + cols, mask=col_ok, other=0.0)
        up = tl.load(gate_up_ptr + K + k + cols, mask=col_ok, other=0.0)
        g = gate.to(tl.float32)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        w = tl.load(w_rows + k + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


def gemv_swiglu(gate_up: torch.Tensor, weight: torch.Tensor, block_n: int = 8, block_k: int = 512,
                num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """silu(gate) * up times weight [N, K]^T for one row gate_up = [gate | up] of 2K values -> [1, N]."""
    gate_up = _one_row(gate_up, weight, 2, "gemv_swiglu needs {} gate/up values")
    return _launch_per_row(_gemv_swiglu_kernel, gate_up, weight, block_n, block_k, num_warps, num_stages)


@triton.jit
def rms_of_sum(x_ptr, residual_ptr, sum_ptr, eps, write_sum, K: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_RESIDUAL: tl.constexpr):
    """1 / rms of the row s = round(x + residual) (x alone without a residual), reduced over K in BLOCK_K chunks
    in float32; with `write_sum` (one program of a launch) s is stored to sum_ptr, the next residual."""
    cols = tl.arange(0, BLOCK_K)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        col_ok = k + cols < K
        s = tl.load(x_ptr + k + cols, mask=col_ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + k + cols, mask=col_ok, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
            if write_sum:
                tl.store(sum_ptr + k + cols, s, mask=col_ok)
        sf = s.to(tl.float32)
        sq += sf * sf
    return tl.rsqrt(tl.sum(sq, 0) / K + eps)


@triton.jit
def normed_values(x_ptr, residual_ptr, norm_w_ptr, offsets, mask, rstd, HAS_RESIDUAL: tl.constexpr):
    """h = RMSNorm(s) at `offsets` (any shape) of the row, with the rounding of fused_ops._rms_norm_kernel:
    s = round(x + residual), h = round(w * round(s * rstd)); in x's dtype, 0 where masked (mask None: every
    offset is inside the row)."""
    s = _masked_load(x_ptr + offsets, mask)
    if HAS_RESIDUAL:
        r = _masked_load(residual_ptr + offsets, mask)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
    h = (s.to(tl.float32) * rstd).to(s.dtype)
    nw = _masked_load(norm_w_ptr + offsets, mask)
    return (nw.to(tl.float32) * h.to(tl.float32)).to(s.dtype)


@triton.jit
def _masked_load(pointers, mask):
    if mask is None:
        values = tl.load(pointers)
    else:
        values = tl.load(pointers, mask=mask, other=0.0)
    return values


@triton.jit
def _gemv_rmsnorm_kernel(x_ptr, residual_ptr, norm_w_ptr, w_ptr, out_ptr, sum_ptr, normed_ptr, N, stride_wn, eps,
                         K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, KEEP_NORMED: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr, PRELOAD: tl.constexpr = 0, SWIGLU_OUT: tl.constexpr = False):
    """As _gemv_kernel on h = RMSNorm(s) with s = x + residual (or x), both computed on the fly (rms_of_sum,
    normed_values). Every program first reduces the row's sum of squares itself (the row is small and
    L2-resident); program 0 also writes s to sum_ptr, the next residual, and with KEEP_NORMED h to normed_ptr
    (for other layers on the same input: a mixture of experts' router and its experts). PRELOAD, SWIGLU_OUT: as
    in _gemv_kernel; the preloaded tiles' loads are in flight while the sum of squares is reduced."""
    pid = tl.program_id(0)
    rows, row_ok = program_rows(pid, N, BLOCK_N, SWIGLU_OUT)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    preloaded = load_first_tiles(w_rows, cols, row_ok, K, BLOCK_K, PRELOAD)
    enter(PDL)
    rstd = rms_of_sum(x_ptr, residual_ptr, sum_ptr, eps, pid == 0, K, BLOCK_K, HAS_RESIDUAL)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t in tl.static_range(PRELOAD):
        acc = _normed_products(acc, preloaded[t], t * BLOCK_K, x_ptr, residual_ptr, norm_w_ptr, normed_ptr, rstd,
                               pid, cols, K, HAS_RESIDUAL, KEEP_NORMED)
    for k in range(PRELOAD * BLOCK_K, K, BLOCK_K):
        w = _weight_tile(w_rows, k, cols, row_ok, K, BLOCK_K)
        acc = _normed_products(acc, w, k, x_ptr, residual_ptr, norm_w_ptr, normed_ptr, rstd, pid, cols, K,
                               HAS_RESIDUAL, KEEP_NORMED)
    store_rows(out_ptr, tl.sum(acc, axis=1), rows, row_ok, pid, N, BLOCK_N, SWIGLU_OUT)


@triton.jit
def _normed_products(acc, w, k, x_ptr, residual_ptr, norm_w_ptr, normed_ptr, rstd, pid, cols, K: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, KEEP_NORMED: tl.constexpr):
    """acc + the weight tile at column k times h there (program 0 stores h with KEEP_NORMED)."""
    col_ok = k + cols < K
    h = normed_values(x_ptr, residual_ptr, norm_w_ptr, k + cols, col_ok, rstd, HAS_RESIDUAL)
    if KEEP_NORMED:
        if pid == 0:
            tl.store(normed_ptr + k + cols, h, mask=col_ok)
    return acc + w.to(tl.float32) * h.to(tl.float32)[None, :]


def gemv_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, block_n: int = 8, block_k: int = 512, num_warps: int = 4,
                 num_stages: int = 3, keep_normed: bool = False, swiglu_out: bool = False,
                 preload: int | None = None) -> tuple[torch.Tensor, ...]:
    """(RMSNorm(s) @ weight^T, s) for one row, s = x + residual (x alone without a residual): the norm of
    the layer before a projection, fused into it. s is a new tensor (x when there is no residual). With
    `keep_normed`, (RMSNorm(s) @ weight^T, s, RMSNorm(s)). With `swiglu_out`, as gemv's: the product's
    silu(gate) * up in place of the product. `preload`: as gemv's."""
    k = weight.shape[1]
    if weight.stride(1) != 1:
        raise ValueError("gemv_rmsnorm needs a row-major weight")
    x, res, summed = normed_row_args(x, residual, norm_weight, k, "gemv_rmsnorm")
    extra = _preload_arg(k, block_k, preload)
    n, programs = output_rows(weight, block_n, swiglu_out)
    if swiglu_out:
        extra["SWIGLU_OUT"] = True
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(x) if keep_normed else out
    _gemv_rmsnorm_kernel[(programs,)](
        x, x if res is None else res, norm_weight, weight, out, summed, normed, n, weight.stride(0), eps, K=k,
        HAS_RESIDUAL=res is not None, KEEP_NORMED=keep_normed, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(weight.device), **extra)
    return (out, summed, normed) if keep_normed else (out, summed)


def normed_row_args(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, k: int,
                    name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """For a norm-fused GEMV: x and the residual as contiguous [1, k] rows, and the tensor the sum goes to (a new
    one; x itself without a residual)."""
    if x.numel() != k or norm_weight.numel() != k or (residual is not None and residual.numel() != k):
        raise ValueError(f"{name} needs {k} inputs, residuals and norm weights, got {tuple(x.shape)}")
    x = x.reshape(1, k).contiguous()
    res = None if residual is None else residual.reshape(1, k).contiguous()
    return x, res, (x if res is None else torch.empty_like(x))
