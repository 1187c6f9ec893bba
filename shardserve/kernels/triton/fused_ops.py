"""Fused elementwise and normalisation kernels, one launch each, matching the torch layers' rounding.

Each kernel reads its inputs once, computes in float32 and rounds to the input dtype at exactly the points
where the torch reference (shardserve.layers) rounds, so 16-bit results equal the reference bit for bit
except where float32 intermediates differ in their last bit (reduction order in RMSNorm, the exp in SiLU) and
that flips a rounding. Rows are the leading dims flattened; the last dim needs unit stride and may have any
size (blocks are padded to a power of two and masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.paged_attention import CACHE_DTYPES, cache_values, is_fp8_cache
from shardserve.kernels.triton.pdl import enter, launch_next


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last] view sharing its memory, or a contiguous copy when no such view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.contiguous().view(-1, x.shape[-1])


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_s,
                     ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     NEXT_EARLY: tl.constexpr = False):
    """One program per row. With ADD_RESIDUAL, s = round(x + residual) is normalised and stored at sum_ptr.

    out = round(weight * round(s * rsqrt(mean(s^2) + eps))), the statistics in float32. PDL: launched to overlap
    the kernel before it (pdl.py); the norm's weight, which no kernel of a step writes, is read before the wait.
    NEXT_EARLY: the next kernel launches at this one's start (pdl.py's early launches).
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if NEXT_EARLY:
        launch_next(PDL)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    enter(PDL, NEXT_EARLY)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    tl.store(out_ptr + row * stride_o + cols, rms_norm_row(x, w, eps, n_cols), mask=mask)


@triton.jit
def rms_norm_row(x, w, eps, n_cols):
    """round(w * round(x * rsqrt(mean(x^2) + eps))) of one row x (zeros past n_cols) in x's dtype, the statistics in
    float32: shardserve.layers.norm.RMSNorm's roundings."""
    h = x.to(tl.float32)
    mean_sq = tl.sum(h * h, 0) / n_cols
    h = (h * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    return (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype)


def check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """A norm weight for rows of x: [x's last dim], x's dtype, unit stride."""
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}] in {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if weight.stride(-1) != 1:
        raise ValueError("weight needs unit stride")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, next_early: bool = False) -> torch.Tensor:
    """weight * round(x * rsqrt(mean(x^2) + eps)) over the last dim; a new tensor shaped like x.

    Same rounding as shardserve.layers.norm.RMSNorm: the normalised value is rounded to x's dtype before the
    product with weight (of x's dtype), which is rounded again. Plain float32 arithmetic for float32 input.
    next_early: the next launch reads nothing of the chain before its wait, so it may be placed at this one's start
    (kernels/triton/pdl.py's early launches).
    """
    check_norm_args(x, weight)
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(x2.shape[1])
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.shape[1], eps,
                                         x2.stride(0), 0, out.stride(0), 0,
                                         ADD_RESIDUAL=False, BLOCK=block, num_warps=_row_warps(block),
                                         **pdl.launch(x.device, next_early))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, next_early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to the dtype, like torch's `x + residual`; next_early as
    rms_norm's.

    In place where possible: s is written into `residual` and the normalised output into `x`, and those two
    tensors are returned. When x or residual has no [rows, hidden] view (unusual strides), the results go to
    new tensors instead; callers must always use the returned pair.
    """
    check_norm_args(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("x and residual must share shape and dtype")
    x2, r2 = _rows(x), _rows(residual)
    if x2.shape[0]:
        block = triton.next_power_of_2(x2.shape[1])
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, x2, r2, x2.shape[1], eps,
                                         x2.stride(0), r2.stride(0), x2.stride(0), r2.stride(0),
                                         ADD_RESIDUAL=True, BLOCK=block, num_warps=_row_warps(block),
                                         **pdl.launch(x.device, next_early))
    return x2.view(x.shape), r2.view(x.shape)


@triton.jit
def _qk_norm_kernel(qk_ptr, q_weight_ptr, k_weight_ptr, num_q_heads, num_heads, eps, stride_t, stride_h,
                    HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr):
    """One program per token: every query and key head normalised in place, as _rms_norm_kernel per head row,
    with the query weight on heads [0, num_q_heads) and the key weight on the rest."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < num_heads)[:, None]
    ptrs = qk_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    mean_sq = tl.sum(h * h, 1) / HEAD_DIM
    h = (h * tl.rsqrt(mean_sq + eps)[:, None]).to(dtype)
    w_q = tl.load(q_weight_ptr + dims).to(tl.float32)
    w_k = tl.load(k_weight_ptr + dims).to(tl.float32)
    w = tl.where((heads < num_q_heads)[:, None], w_q[None, :], w_k[None, :])
    tl.store(ptrs, (w * h.to(tl.float32)).to(dtype), mask=mask)


def qk_rms_norm_(qk: torch.Tensor, num_q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Per-head RMSNorm (Qwen3's q_norm and k_norm) of qk [tokens, q heads + kv heads, head_dim], query heads
    first, in place and in one launch; returns qk. Same rounding as rms_norm on each head. qk may be a strided
    view (the query and key heads of a fused projection) with unit stride in the last dim."""
    tokens, num_heads, head_dim = qk.shape
    for weight in (q_weight, k_weight):
        check_norm_args(qk, weight)
    if qk.stride(-1) != 1 or head_dim & (head_dim - 1):
        raise ValueError("qk needs unit stride in the last dim and a power-of-two head_dim")
    if tokens:
        heads_p = triton.next_power_of_2(num_heads)
        _qk_norm_kernel[(tokens,)](qk, q_weight, k_weight, num_q_heads, num_heads, eps, qk.stride(0),
                                   qk.stride(1), HEAD_DIM=head_dim, HEADS_P=heads_p,
                                   num_warps=4 if heads_p * head_dim <= 4096 else 8)
    return qk


# ---------------------------------------------------------------------------------------------------------------
# SwiGLU


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    """Program (row, column block): out = round(round(silu(gate)) * up), silu in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], rounded like `F.silu(gate) * up` in x's dtype.

    torch computes F.silu of a 16-bit tensor in float32 and rounds once, then rounds the product; so does
    this kernel. Returns a new tensor [..., d].
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, x2.stride(0), out.stride(0),
                                                                   BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], d)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, gate_ptr, stride_x, stride_gt, stride_gh, HEAD_DIM: tl.constexpr,
                         DIM_P: tl.constexpr):
    """Program (token, head): x <- round(x * round(sigmoid(gate))), sigmoid in float32."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, DIM_P)
    mask = dims < HEAD_DIM
    x_at = x_ptr + token * stride_x + head * HEAD_DIM + dims
    x = tl.load(x_at, mask=mask, other=0.0)
    g = tl.load(gate_ptr + token * stride_gt + head * stride_gh + dims, mask=mask, other=0.0)
    tl.store(x_at, sigmoid_gated_values(x, g), mask=mask)


@triton.jit
def sigmoid_gated_values(x, g):
    """round(x * round(sigmoid(g))) in x's dtype, the sigmoid in float32: `x * torch.sigmoid(gate)`'s rounding
    (the sigmoid gate kernel's, and the decode attention launch's output gate, kernels/triton/paged_decode.py)."""
    s = tl.div_rn(1.0, 1.0 + tl.exp(-g.to(tl.float32))).to(x.dtype)
    return (x.to(tl.float32) * s.to(tl.float32)).to(x.dtype)


def sigmoid_gate_(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads * D] (rows contiguous) times sigmoid(gate), gate [tokens, heads, D] (any token and head
    strides, unit stride within a head, e.g. the gate rows of a fused projection), in place; rounded like
    `x * torch.sigmoid(gate)` in x's dtype (the sigmoid rounded, then the product). One launch for what torch does
    in three (the gate's copy, the sigmoid, the product)."""
    tokens, heads, dim = gate.shape
    if x.shape != (tokens, heads * dim) or x.stride(1) != 1 or gate.stride(2) != 1 or x.dtype != gate.dtype:
        raise ValueError(f"sigmoid_gate_ needs x [{tokens}, {heads * dim}] with unit stride and a gate of its dtype "
                         f"with unit stride within heads, got {tuple(x.shape)} and {tuple(gate.shape)}")
    if tokens and heads:
        _sigmoid_gate_kernel[(tokens, heads)](x, gate, x.stride(0), gate.stride(0), gate.stride(1),
                                              HEAD_DIM=dim, DIM_P=triton.next_power_of_2(dim),
                                              num_warps=1 if dim <= 256 else 4, enable_fp_fusion=False)
    return x


# ---------------------------------------------------------------------------------------------------------------
# Rotary embedding


@triton.jit
def rotate_rows(x, x_rolled, cos, sin):
    """round(round(x * cos) + round(x_rolled * sin)) in x's dtype: torch's rounding of the rotate-half form
    (x_rolled = roll(x, head_dim / 2), sin = the signed table; cos and sin in float32, [head_dim]). Bit-exact
    only where the launch disables multiply-add contraction (enable_fp_fusion=False)."""
    dtype = x.dtype
    a = (x.to(tl.float32) * cos[None, :]).to(dtype)
    b = (x_rolled.to(tl.float32) * sin[None, :]).to(dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dtype)


@triton.jit
def head_rms_norm(x, x_rolled, w, w_rolled, eps, HEAD_DIM: tl.constexpr):
    """Per-head RMSNorm (Qwen3's q_norm / k_norm) of head rows x [R, HEAD_DIM] and of the same rows rolled by
    half a head (the same values, so one sum of squares serves both), with the weight w and its rolled copy;
    rounded where shardserve.layers.norm.RMSNorm rounds. Returns both, normalised."""
    dtype = x.dtype
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 1) / HEAD_DIM + eps)[:, None]
    x = (w.to(tl.float32) * (x32 * inv_rms).to(dtype).to(tl.float32)).to(dtype)
    x_rolled = (w_rolled.to(tl.float32) * (x_rolled.to(tl.float32) * inv_rms).to(dtype).to(tl.float32)).to(dtype)
    return x, x_rolled


@triton.jit
def normed_heads(row_ptrs, row_ok, weight_ptr, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
                 ROTARY_DIM: tl.constexpr = 0):
    """Head rows at row_ptrs [R] (unit stride along the head) and the same rows rolled by half a head, as
    rotate_rows takes them; normalised with weight_ptr's weight if NORM (as head_rms_norm). Rows where row_ok is
    false read as 0. ROTARY_DIM (0: the whole head): only a head's first ROTARY_DIM dims are rotated, so those
    roll by half of ROTARY_DIM among themselves and the others stay in place (rotary_tables gives them cos 1 and
    sin 0)."""
    dims = tl.arange(0, HEAD_DIM)
    if ROTARY_DIM == 0:
        rolled = (dims + HEAD_DIM // 2) % HEAD_DIM
    else:
        rolled = tl.where(dims < ROTARY_DIM, (dims + ROTARY_DIM // 2) % ROTARY_DIM, dims)
    x = tl.load(row_ptrs[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    x_rolled = tl.load(row_ptrs[:, None] + rolled[None, :], mask=row_ok[:, None], other=0.0)
    if NORM:
        x, x_rolled = head_rms_norm(x, x_rolled, tl.load(weight_ptr + dims)[None, :],
                                    tl.load(weight_ptr + rolled)[None, :], eps, HEAD_DIM)
    return x, x_rolled


@triton.jit
def rotary_tables(cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr = 0):
    """(cos, signed sin) in float32 over a head's HEAD_DIM dims from one position's table rows; with ROTARY_DIM
    (tables that narrow) cos 1 and sin 0 past them, which rotate_rows turns into the dims unchanged, bit for bit
    (x * 1 + x * 0 rounds to x)."""
    dims = tl.arange(0, HEAD_DIM)
    if ROTARY_DIM == 0:
        cos = tl.load(cos_ptr + dims).to(tl.float32)
        sin = tl.load(sin_ptr + dims).to(tl.float32)
    else:
        cos = tl.load(cos_ptr + dims, mask=dims < ROTARY_DIM, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + dims, mask=dims < ROTARY_DIM, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(qk_ptr, pos_ptr, cos_ptr, sin_ptr, num_heads, stride_t, stride_h, stride_cos, stride_sin,
                   HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token, head block): x <- round(round(x * cos) + round(roll(x, D/2) * signed_sin)).

    Both x and its rolled copy are loaded before the store, so rotating in place is safe: a program owns whole
    head rows.
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, DIM_P)
    dim_ok = dims < HEAD_DIM
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM
    mask = (heads < num_heads)[:, None] & dim_ok[None, :]
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + dims, mask=dim_ok, other=0.0).to(tl.float32)
    base = qk_ptr + token * stride_t + heads[:, None] * stride_h
    x = tl.load(base + dims[None, :], mask=mask, other=0.0)
    x_rolled = tl.load(base + rolled[None, :], mask=mask, other=0.0)
    tl.store(base + dims[None, :], rotate_rows(x, x_rolled, cos, sin), mask=mask)


def apply_rotary_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate qk [tokens, heads, head_dim] in place and return it.

    Result: qk * cos[pos] + roll(qk, head_dim // 2, -1) * signed_sin[pos], with the tables of
    shardserve.layers.rotary.RotaryEmbedding ([max_pos, head_dim], qk's dtype) and positions int32/int64
    [tokens]. Each product and the sum are rounded to the dtype as torch does, and the launch disables
    multiply-add contraction, so the result equals shardserve.layers.rotary.apply_rotary bit for bit (for
    float32 too). qk may be a strided view (e.g. the query and key heads of a fused projection) with unit stride
    in the last dim.
    """
    tokens, num_heads, head_dim = qk.shape
    if qk.stride(-1) != 1 or cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("qk and the tables need unit stride in the last dim")
    if head_dim % 2 or cos.shape[-1] != head_dim or signed_sin.shape[-1] != head_dim:
        raise ValueError("head_dim must be even and match the tables")
    if cos.dtype != qk.dtype or signed_sin.dtype != qk.dtype:
        raise ValueError("the tables must have qk's dtype")
    if tokens == 0 or num_heads == 0:
        return qk
    dim_p = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // dim_p))
    _rotary_kernel[(tokens, triton.cdiv(num_heads, block_h))](
        qk, positions, cos, signed_sin, num_heads, qk.stride(0), qk.stride(1), cos.stride(0),
        signed_sin.stride(0), HEAD_DIM=head_dim, DIM_P=dim_p, BLOCK_H=block_h, num_warps=4,
        enable_fp_fusion=False)
    return qk


# ---------------------------------------------------------------------------------------------------------------
# Rotary embedding fused with the KV cache write


@triton.jit
def _rotary_store_kernel(qk_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                         q_weight_ptr, k_weight_ptr, eps, k_scale, v_scale,
                         num_q_heads, num_kv_heads, stride_t, stride_h, stride_vt, stride_vh, stride_cos, stride_sin,
                         stride_kcs, stride_kch, stride_vcs, stride_vch,
                         HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr, KV_P: tl.constexpr, NORM: tl.constexpr,
                         PDL: tl.constexpr, KV_FP8: tl.constexpr):
    """One program per token: with NORM, first normalises each query and key head (as _qk_norm_kernel: the same
    roundings); rotates them in place (as _rotary_kernel), then writes the rotated keys and the values to the
    token's cache slot as the cache holds them (cache_values: an FP8 cache's scales), or nowhere where the slot
    is negative. PDL: as in kernels/triton/pdl.py."""
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM)
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM
    num_heads = num_q_heads + num_kv_heads
    mask = (heads < num_heads)[:, None]
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + dims).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + dims).to(tl.float32)
    base = qk_ptr + token * stride_t + heads[:, None] * stride_h
    x = tl.load(base + dims[None, :], mask=mask, other=0.0)
    x_rolled = tl.load(base + rolled[None, :], mask=mask, other=0.0)
    if NORM:
        is_query = (heads < num_q_heads)[:, None]
        w = tl.where(is_query, tl.load(q_weight_ptr + dims)[None, :], tl.load(k_weight_ptr + dims)[None, :])
        w_rolled = tl.where(is_query, tl.load(q_weight_ptr + rolled)[None, :],
                            tl.load(k_weight_ptr + rolled)[None, :])
        x, x_rolled = head_rms_norm(x, x_rolled, w, w_rolled, eps, HEAD_DIM)
    rotated = rotate_rows(x, x_rolled, cos, sin)
    tl.store(base + dims[None, :], rotated, mask=mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    is_key = ((heads >= num_q_heads) & (heads < num_heads))[:, None] & (slot >= 0)
    key_heads = tl.where(heads >= num_q_heads, heads - num_q_heads, 0)
    tl.store(k_cache_ptr + slot * stride_kcs + key_heads[:, None] * stride_kch + dims[None, :],
             cache_values(rotated, k_scale, k_cache_ptr, KV_FP8), mask=is_key)
    kv_heads = tl.arange(0, KV_P)
    v_mask = (kv_heads < num_kv_heads)[:, None] & (slot >= 0)
    v = tl.load(v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + dims[None, :], mask=v_mask, other=0.0)
    tl.store(v_cache_ptr + slot * stride_vcs + kv_heads[:, None] * stride_vch + dims[None, :],
             cache_values(v, v_scale, v_cache_ptr, KV_FP8), mask=v_mask)


def apply_rotary_and_store_(qk: torch.Tensor, num_q_heads: int, value: torch.Tensor, positions: torch.Tensor,
                            cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, head_norm: tuple | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """apply_rotary_ on qk [tokens, q heads + kv heads, head_dim] (query heads first), then the key heads and
    `value` [tokens, kv heads, head_dim] written to the cache at slot_mapping (negative: not written), in one
    launch. Same numbers as apply_rotary_ followed by store_kv_cache. With head_norm = (query weight, key
    weight, eps), each head is first normalised as qk_rms_norm_ does; k_scale, v_scale: an FP8 cache's (as
    store_kv_cache). Returns qk, rotated in place."""
    tokens, num_heads, head_dim = qk.shape
    num_kv_heads = num_heads - num_q_heads
    if qk.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("qk, value and the caches need unit stride in the last dim")
    if head_dim & (head_dim - 1) or cos.shape[-1] != head_dim or signed_sin.shape[-1] != head_dim:
        raise ValueError("head_dim must be a power of two and match the tables")
    if value.shape != (tokens, num_kv_heads, head_dim) or k_cache.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError("value and cache shapes disagree with the key heads")
    if cos.dtype != qk.dtype or signed_sin.dtype != qk.dtype:
        raise ValueError("the tables must have qk's dtype")
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in CACHE_DTYPES + (qk.dtype,):
        raise ValueError(f"the caches must share a dtype, qk's or one of {CACHE_DTYPES}")
    if head_norm is not None:
        for weight in head_norm[:2]:
            check_norm_args(qk, weight)
    if tokens == 0:
        return qk
    heads_p = triton.next_power_of_2(num_heads)
    q_weight, k_weight, eps = head_norm if head_norm is not None else (qk, qk, 0.0)
    _rotary_store_kernel[(tokens,)](
        qk, value, positions, slot_mapping, cos, signed_sin, k_cache, v_cache, q_weight, k_weight, eps, k_scale,
        v_scale, num_q_heads, num_kv_heads,
        qk.stride(0), qk.stride(1), value.stride(0), value.stride(1), cos.stride(0), signed_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEAD_DIM=head_dim, HEADS_P=heads_p, KV_P=triton.next_power_of_2(num_kv_heads), NORM=head_norm is not None,
        KV_FP8=is_fp8_cache(k_cache),
        num_warps=4 if heads_p * head_dim <= 4096 else 8, enable_fp_fusion=False, **pdl.launch(qk.device))
    return qk
