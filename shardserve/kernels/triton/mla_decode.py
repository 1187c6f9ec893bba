"""Decode attention of multi-head latent attention (MLA, DeepSeek-V2/V3) over its paged latent cache, in the
absorbed form: one query token per sequence, every query head against the one cached row per token.

A cache row is [latent (L) | rotated rope key (R)] (L = kv_lora_rank, 512 in DeepSeek-V3; R = qk_rope_head_dim,
64), one per (block, offset) slot, shared by all heads. The absorbed query of a head is [q_nope @ W_UK | q_rope]
([L + R]); its score against a position is that row's dot product with the cached row, and its value is the
latent part of the cached row, so the output is in latent space ([L]; W_UV and o_proj follow outside).

A program takes one sequence, a block of BLOCK_H heads (tensor-core dots need 16 rows: fewer heads are padded)
and one split of the context (flash-decoding): every cached row is read once per program, by each head block. With
several splits, each writes its normalised partial output and log2-sum-exp to a float32 workspace and paged
decode's combine kernel (kernels/triton/paged_decode.py) joins them. Launches depend only on shapes and Python ints,
never on tensor contents: decode can be captured in a CUDA graph.

Around it, a decode step's other launches (layers/mla.MultiHeadLatentAttention.fused_decode): one that stores each
token's cache entry and rotates the queries (store_entries_rotate_queries), and the absorbed products of a few
tokens (few_rows_bmm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton.fused_ops import rms_norm_row, rotate_rows
from shardserve.kernels.triton.paged_attention import LOG2E, cache_values, dot_precision
from shardserve.kernels.triton.paged_decode import _combine_splits_kernel


@triton.jit
def _mla_decode_kernel(q_ptr, q_rope_ptr, cache_ptr, out_ptr, lse_ptr, block_tables_ptr, context_lens_ptr,
                       qk_scale, num_splits, num_heads,
                       stride_qb, stride_qh, stride_rb, stride_rh, stride_cs, stride_bt,
                       stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                       LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False):
    """Program (b, head block, split). The context [0, context_lens[b]) is cut into num_splits ranges of equal
    length, a multiple of BLOCK_N (the last ones shorter or empty). With SPLIT, writes the normalised partial
    output (float32) at out[b, head, split] and its log2-sum-exp at lse[b, head, split] (-inf where the range is
    empty); otherwise the final output at out[b, head]. KV_FP8: the cache holds e4m3 entries (scale 1.0), widened to
    the query's dtype as they are loaded."""
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < num_heads
    context = tl.load(context_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(context, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, context)

    latent_dims = tl.arange(0, LATENT)
    rope_dims = tl.arange(0, ROPE)
    q_latent = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + latent_dims[None, :],
                       mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_rope_ptr + b * stride_rb + heads[:, None] * stride_rh + rope_dims[None, :],
                     mask=head_ok[:, None], other=0.0)
    table_row = block_tables_ptr + b * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        rows = cache_ptr + (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_cs
        latent = tl.load(rows + latent_dims[None, :], mask=ok[:, None], other=0.0)  # [N, L]: keys and values
        rope = tl.load(rows + LATENT + rope_dims[None, :], mask=ok[:, None], other=0.0)
        if KV_FP8:
            latent = latent.to(q_latent.dtype)
            rope = rope.to(q_rope.dtype)
        s = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        if ROPE >= 16:
            s += tl.dot(q_rope, tl.trans(rope), input_precision=DOT_PRECISION)
        else:  # narrower than a tensor-core product takes (tiny test models)
            s += tl.sum(q_rope[:, None, :].to(tl.float32) * rope[None, :, :].to(tl.float32), 2)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one position below hi
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + latent_dims[None, :],
                 out, mask=head_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_ok)
    else:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + latent_dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def launch_config(num_heads: int) -> dict:
    """BLOCK_H heads a program (16, the rows of a tensor-core dot: a wider block's float32 accumulator of 512 latent
    features spills), BLOCK_N cached rows a tile (32 rows of 576 bf16 are 36 KiB: two in flight), num_warps and
    num_stages. On an H200 (benchmarks/mla_decode.py, us): 128 heads at batch 1 over 1,024 positions 10.9 with
    BLOCK_H 16, 14.0 with 32 (8 warps), 15.5 with 64 (8 warps), 105 with 64 (4 warps); at batch 64 over 8,192,
    1,305 / 1,717 / 1,392 / 3,237; 16 heads, BLOCK_N 64 or 8 warps: 5-55% slower everywhere."""
    return dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2)


def latent_num_splits(batch: int, head_blocks: int, max_context: int, num_sms: int, block_n: int) -> int:
    """Splits of the context: about two programs per SM where batch x head blocks is small, and at least two tiles
    a split of max_context (a program's tiles run one after another, about 2 us each at batch 1 on an H200:
    benchmarks/mla_decode.py), at most 32 (what the combine kernel joins)."""
    wanted = triton.cdiv(2 * num_sms, max(1, batch * head_blocks))
    return int(max(1, min(wanted, max_context // (2 * block_n), 32)))


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               block_size: int, scale: float, latent_dim: int, num_splits: int | None = None,
               out: torch.Tensor | None = None, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed-form MLA decode. q: [B, H, L + R] (unit last stride); cache: [num_slots, L + R] or
    [num_slots, 1, L + R] (slot = block * block_size + offset) in q's dtype or e4m3 (an FP8 latent cache, scale
    1.0); block_tables: int32 [B, max_blocks];
    context_lens: int32 [B] (0: a padding row, output 0); q_rope: the rotated query [B, H, R] apart, q then being
    the latent query [B, H, L] alone (either may be a strided view, unit last stride; out too); scale: the softmax
    scale; num_splits: of the context,
    by default latent_num_splits' for the batch, its head blocks and the tables' width (known on the host: no
    synchronisation). Returns [B, H, L] in q's dtype: softmax(q . cache rows * scale) @ cache rows' latent
    parts."""
    cache = cache.reshape(cache.shape[0], cache.shape[-1])
    if q_rope is None:
        q, q_rope = q[..., :latent_dim], q[..., latent_dim:]
    batch, num_heads, _ = q.shape
    rope_dim = q_rope.shape[-1]
    width = latent_dim + rope_dim
    if (cache.shape[1] != width or q.shape[-1] != latent_dim or q.stride(2) != 1 or q_rope.stride(2) != 1
            or cache.stride(1) != 1):
        raise ValueError(f"MLA decode: the query rows [{width}] and cache rows [{cache.shape[1]}] differ, or a row "
                         "is not contiguous")
    if latent_dim & (latent_dim - 1) or rope_dim & (rope_dim - 1):
        raise ValueError(f"MLA decode needs power-of-two latent and rope widths, got {latent_dim} and {rope_dim}")
    if out is None:
        out = torch.empty(batch, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    config = launch_config(num_heads)
    head_blocks = triton.cdiv(num_heads, config["BLOCK_H"])
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        num_splits = latent_num_splits(batch, head_blocks, block_tables.shape[1] * block_size, sms,
                                       config["BLOCK_N"])
    grid = (batch, head_blocks, max(1, int(num_splits)))
    qk_scale = scale * LOG2E
    common = dict(LATENT=latent_dim, ROPE=rope_dim, BLOCK_SIZE=block_size, KV_FP8=cache.dtype == torch.float8_e4m3fn,
                  DOT_PRECISION=dot_precision(q.dtype), **config)
    if grid[2] == 1:
        _mla_decode_kernel[grid](q, q_rope, cache, out, out, block_tables, context_lens, qk_scale, 1, num_heads,
                                 q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
                                 block_tables.stride(0),
                                 out.stride(0), out.stride(1), 0, 0, 0, SPLIT=False, **common)
        return out
    partial = torch.empty(batch, num_heads, grid[2], latent_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, grid[2], dtype=torch.float32, device=q.device)
    _mla_decode_kernel[grid](q, q_rope, cache, partial, lse, block_tables, context_lens, qk_scale, grid[2],
                             num_heads, q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
                             block_tables.stride(0),
                             partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
                             SPLIT=True, **common)
    _combine_splits_kernel[(batch, num_heads)](partial, lse, out, grid[2], partial.stride(0), partial.stride(1),
                                               partial.stride(2), lse.stride(0), lse.stride(1), out.stride(0),
                                               out.stride(1), out, 0, 0,  # no output gate
                                               SPLITS_P=triton.next_power_of_2(grid[2]), HEAD_DIM=latent_dim,
                                               PDL=False)
    return out


@triton.jit
def _rope_sources(ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For each rotated dim d of a rope vector, where its value and its rotate-half partner come from: the dims
    themselves, or with INTERLEAVED the deinterleaved order [even dims | odd dims] (layers/mla.deinterleaved)."""
    dims = tl.arange(0, ROPE)
    half: tl.constexpr = ROPE // 2
    rolled = (dims + half) % ROPE
    if INTERLEAVED:
        return tl.where(dims < half, 2 * dims, 2 * (dims - half) + 1), tl.where(rolled < half, 2 * rolled,
                                                                               2 * (rolled - half) + 1)
    return dims, rolled


@triton.jit
def _store_entry_rotate_query_kernel(kv_ptr, q_ptr, q_out_ptr, norm_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr,
                                     slot_ptr, eps, entry_scale, num_heads, stride_kv, stride_qt, stride_qh,
                                     stride_ot, stride_oh,
                                     stride_cos, stride_sin, stride_cs,
                                     LATENT: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                                     BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr):
    """Program t: token t's rotated query heads into q_out, and (unless its slot is negative) its cache entry
    [kv_a_layernorm(latent) | rotated rope key] into the cache, with the roundings of the torch ops it replaces
    (rms_norm's and apply_rotary_'s: bit-exact where the launch disables multiply-add contraction)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, ROPE)
    src, src_rolled = _rope_sources(ROPE, INTERLEAVED)
    cos = tl.load(cos_ptr + pos * stride_cos + dims).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + dims).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)
    for first in range(0, num_heads, BLOCK_H):
        ok = (first + heads < num_heads)[:, None]
        rows = q_ptr + t * stride_qt + (first + heads)[:, None] * stride_qh
        x = tl.load(rows + src[None, :], mask=ok, other=0.0)
        x_rolled = tl.load(rows + src_rolled[None, :], mask=ok, other=0.0)
        tl.store(q_out_ptr + t * stride_ot + (first + heads)[:, None] * stride_oh + dims[None, :],
                 rotate_rows(x, x_rolled, cos, sin), mask=ok)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        row = kv_ptr + t * stride_kv
        latent_dims = tl.arange(0, LATENT)
        normed = rms_norm_row(tl.load(row + latent_dims), tl.load(norm_ptr + latent_dims), eps, LATENT)
        k = tl.load(row + LATENT + src)[None, :]
        k_rolled = tl.load(row + LATENT + src_rolled)[None, :]
        entry = cache_ptr + slot * stride_cs
        tl.store(entry + latent_dims, cache_values(normed, entry_scale, cache_ptr, KV_FP8))
        tl.store(entry + LATENT + dims[None, :], cache_values(rotate_rows(k, k_rolled, cos, sin), entry_scale,
                                                              cache_ptr, KV_FP8))


def store_entries_rotate_queries(kv: torch.Tensor, q_rope: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                                 cache: torch.Tensor, slots: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A decode step's latent-attention preparation in one launch. kv: kv_a_proj_with_mqa's output [T, L + R]
    (latent, then the unrotated rope key); q_rope: the queries' unrotated rope parts [T, H, R] (a strided view of
    the projection is fine); positions [T]; cos, signed_sin: the rotary tables [max_pos, R] (layers/rotary.py);
    cache: the latent cache [num_slots, (1,) L + R] (the model's dtype or e4m3 with scale 1.0); slots [T] (-1:
    store nothing). Stores each token's entry [kv_a_layernorm(latent) | rotated key] and returns the rotated query
    rope parts [T, H, R], contiguous. Rotation, norm and rounding are those of the torch ops (attention/mla.py's
    torch path: deinterleaved for `interleaved`, rotary.apply, RMSNorm, kv_quant.store)."""
    tokens, heads, rope = q_rope.shape
    latent = kv.shape[1] - rope
    cache = cache.reshape(cache.shape[0], cache.shape[-1])
    if (kv.stride(1) != 1 or q_rope.stride(2) != 1 or cos.shape[-1] != rope or cache.shape[1] != kv.shape[1]
            or latent & (latent - 1) or rope & (rope - 1)):
        raise ValueError("MLA decode preparation: rows must be contiguous, the tables as wide as the rope dims, the "
                         "cache rows as wide as kv_a_proj's, and the latent and rope widths powers of two")
    out = torch.empty(tokens, heads, rope, dtype=q_rope.dtype, device=q_rope.device)
    if tokens:
        _store_entry_rotate_query_kernel[(tokens,)](
            kv, q_rope, out, norm_weight, positions, cos, signed_sin, cache, slots, eps, 1.0, heads, kv.stride(0),
            q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1), cos.stride(0), signed_sin.stride(0),
            cache.stride(0), LATENT=latent, ROPE=rope, INTERLEAVED=interleaved,
            BLOCK_H=min(16, triton.next_power_of_2(heads)), KV_FP8=cache.dtype == torch.float8_e4m3fn, num_warps=4,
            enable_fp_fusion=False)
    return out


@triton.jit
def _few_rows_bmm_kernel(a_ptr, b_ptr, out_ptr, rows, stride_ab, stride_am, stride_ak, stride_bb, stride_bk,
                         stride_bn, stride_ob, stride_om, K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (batch b, column block): out[b, m, cols] = sum_k a[b, m, k] * b[b, k, cols] for each of the few
    rows m, the [K, BLOCK_N] tile of b loaded once; products and sums in float32, rounded to out's dtype."""
    batch = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K)
    col_ok = cols < N
    w = tl.load(b_ptr + batch * stride_bb + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                mask=col_ok[None, :], other=0.0).to(tl.float32)
    for m in range(rows):
        x = tl.load(a_ptr + batch * stride_ab + m * stride_am + ks * stride_ak).to(tl.float32)
        y = tl.sum(w * x[:, None], 0)
        tl.store(out_ptr + batch * stride_ob + m * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


# Rows (decode tokens) up to which few_rows_bmm runs its own kernel: at batch 1 on an H200 cuBLAS's batched product
# of latent attention's absorption (16 heads, [1 x 128] @ [128 x 512], 2 MB of weights) took 3.4 us, its W_UV
# product 3.3 us.
FEW_ROWS = 4


def few_rows_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) for a [B, M, K], b [B, K, N] (strided views allowed) into a new [B, M, N] in a's dtype: on CUDA
    with M <= FEW_ROWS and K a power of two, one launch that streams b's tiles once (each a [K, 64] block of
    columns, every row's product from it); otherwise torch.bmm."""
    rows, k = a.shape[1:]
    if not (a.is_cuda and rows <= FEW_ROWS and k & (k - 1) == 0 and k <= 512):
        return torch.bmm(a, b)
    return few_rows_products(a, b)


def few_rows_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """few_rows_bmm's kernel on any device (CPU tensors: Triton's interpreter)."""
    batch, rows, k = a.shape
    n = b.shape[2]
    out = torch.empty(batch, rows, n, dtype=a.dtype, device=a.device)
    block_n = max(16, min(64, 8192 // k))
    _few_rows_bmm_kernel[(batch, triton.cdiv(n, block_n))](
        a, b, out, rows, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        out.stride(1), K=k, N=n, BLOCK_N=block_n, num_warps=4)
    return out


def mla_decode_reference(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, block_size: int, scale: float, latent_dim: int) -> torch.Tensor:
    """mla_decode in float64 torch, a sequence at a time (tests, the start-up check)."""
    cache = cache.reshape(cache.shape[0], cache.shape[-1]).double()
    out = torch.zeros(q.shape[0], q.shape[1], latent_dim, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        rows = cache[block_tables[b, pos // block_size].long() * block_size + pos % block_size]
        weights = torch.softmax(q[b].double() @ rows.T * scale, dim=-1)
        out[b] = weights @ rows[:, :latent_dim]
    return out

