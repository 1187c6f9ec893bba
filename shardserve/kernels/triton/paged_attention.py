"""Attention over the paged KV cache, and the cache write, as Triton kernels: the layout, the tile step every
attention kernel shares, prefill (decode: shardserve/kernels/triton/paged_decode.py).

Cache layout (one layer): `k_cache` and `v_cache` are [num_slots, num_kv_heads, head_dim] with unit stride in
the last dim, and `slot = block_id * block_size + offset`. Row s of `block_tables` (int32
[num_seqs, max_blocks]) lists sequence s's block ids in position order, so position p lives at slot
`block_tables[s, p // block_size] * block_size + p % block_size`; entries past a sequence's length are never
read. Query head h reads KV head `h // (num_heads // num_kv_heads)`.

Numerics: scores, softmax statistics and accumulators are float32 whatever the input dtype; outputs are in the
input dtype. The caches may hold another dtype than q (bfloat16, or FP8 e4m3 with a scale for keys and one for
values: attention/kv_quant.py): a tile is converted to q's dtype in registers (exact for FP8 into 16-bit or float32),
the key scale multiplies the float32 scores and the value scale the float32 output, so attention reads
stored * scale; writes go through cache_values. Decode over an FP8 cache with bfloat16 q converts its tiles to
float16 instead, q's rows scaled by powers of two (tile_operand: the same scores). For float32 inputs every matrix
product runs at full IEEE float32 precision (never TF32), so results agree with torch's float32 attention to
rounding; 16-bit inputs use tensor cores, with the softmax weights rounded to the tiles' dtype before they
multiply V, as in FlashAttention.

Every launch depends only on tensor shapes and Python ints, never on tensor contents, so the decode path can be
captured in a CUDA graph: sequence lengths are read inside the kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


LOG2E = 1.4426950408889634
# Cache dtypes other than q's that the kernels read and write.
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


@triton.jit
def cache_values(x, scale, cache_ptr, KV_FP8: tl.constexpr):
    """x as the cache at cache_ptr holds it: with KV_FP8, x / scale (rounded division) saturated to +-448, in e4m3
    rounded to nearest even (attention/kv_quant.encode's bits); otherwise x cast to the cache's dtype."""
    if KV_FP8:
        x = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> None:
    """The shapes, strides and dtypes every attention kernel here needs: q [tokens, heads, head_dim] and the
    caches [slots, kv_heads, head_dim], unit last-dim stride, one dtype; head_dim and block_size powers of two."""
    head_dim, num_heads, num_kv_heads = q.shape[-1], q.shape[-2], k_cache.shape[1]
    _check_head_dim(head_dim)
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need unit stride in the last dim")
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in CACHE_DTYPES + (q.dtype,):
        raise ValueError(f"the caches must share a dtype, q's or one of {CACHE_DTYPES}; got {k_cache.dtype}, "
                         f"{v_cache.dtype} for q in {q.dtype}")


def dot_precision(dtype: torch.dtype) -> str:
    """Full-precision products for float32 (TF32 would change greedy tokens); the default for 16-bit types."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Launch parameters of the prefill kernel, sized so the pipelined K/V tiles fit in shared memory."""
    row_bytes = head_dim * torch.finfo(dtype).bits // 8
    return dict(BLOCK_M=64 if row_bytes <= 512 else 32, BLOCK_N=64 if row_bytes <= 256 else 32,
                num_warps=4 if head_dim <= 128 else 8, num_stages=2)


# ---------------------------------------------------------------------------------------------------------------
# Cache write


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch,
                     HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr):
    """One program per token: writes all its KV heads to its slot (cache_values), or nothing where the slot is
    negative."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < num_kv_heads)[:, None] & (slot >= 0)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    tl.store(k_cache_ptr + slot * stride_kcs + heads[:, None] * stride_kch + dims[None, :],
             cache_values(k, k_scale, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcs + heads[:, None] * stride_vch + dims[None, :],
             cache_values(v, v_scale, v_cache_ptr, KV_FP8), mask=mask)


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] to the cache at `slot_mapping` (int32 or int64),
    in the cache's dtype (an FP8 cache: divided by k_scale / v_scale, cache_values).

    Rows whose slot is negative are skipped (padding rows of a CUDA-graph batch use -1). key and value may be
    strided views as long as the last dim has unit stride. One launch.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_head_dim(head_dim)
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("store_kv_cache needs unit stride in the last dim")
    if value.shape != key.shape or k_cache.shape[1:] != key.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError("key/value and cache shapes disagree")
    heads_p = triton.next_power_of_2(num_kv_heads)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEADS_P=heads_p, HEAD_DIM=head_dim, KV_FP8=is_fp8_cache(k_cache),
        num_warps=4 if heads_p * head_dim <= 2048 else 8)


# ---------------------------------------------------------------------------------------------------------------
# Shared tile step


@triton.jit
def tile_operand(q, qk_scale, KV_FP8: tl.constexpr):
    """q as the tile steps multiply it, and the factor that turns their products into log2-unit scores.

    Where the cache is FP8 and q bfloat16, the tiles are converted to float16 (e4m3 -> float16 is one
    instruction for two values on sm_89+, bfloat16 three: float16 first, then per value), so q must be too:
    each row r is multiplied by the power of two 2^u_r that puts its largest magnitude in [2^14, 2^15), where
    float16's 11 significant bits hold bfloat16's 8 (exact down to 2^-31 of a row's largest magnitude, smaller
    values rounded by at most 2^-39 of it), and the factor is qk_scale * 2^-u_r per row. The products and their
    float32 sums only move by powers of two, so the scores keep the bits bfloat16 operands give them. Otherwise
    q and qk_scale as given."""
    if KV_FP8 and q.dtype == tl.bfloat16:
        largest = tl.max(tl.abs(q.to(tl.float32)), 1)
        # float32 exponent field of the largest magnitude, clipped so that both powers below are normal (rows
        # under 2^-112, zero rows among them, get 2^126 and stay below 2^14)
        exponent = tl.minimum(tl.maximum((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)
        up = ((268 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(141 - exponent)
        down = ((exponent - 14) << 23).to(tl.float32, bitcast=True)  # its inverse
        operand = (q.to(tl.float32) * up[:, None]).to(tl.float16)
        factor = (qk_scale * down)[:, None]
    else:
        operand = q
        factor = qk_scale
    return operand, factor


@triton.jit
def load_kv_tile(k_base, v_base, table_row, stride_s, start, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """The keys and values [BLOCK_N, D] of positions [start, start + BLOCK_N) clipped to `end`, gathered slot by
    slot through the block table (positions >= end are never loaded; they read as 0), with the positions and
    their mask: the operands of attend_loaded."""
    pos = start + tl.arange(0, BLOCK_N)
    in_range = pos < end
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=in_range, other=0)
    slots = block.to(tl.int64) * BLOCK_SIZE + (pos % BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM)
    offsets = slots[:, None] * stride_s + dims[None, :]
    k = tl.load(k_base + offsets, mask=in_range[:, None], other=0.0)
    v = tl.load(v_base + offsets, mask=in_range[:, None], other=0.0)
    return k, v, pos, in_range


@triton.jit
def _fp8_to_f16(x):
    """e4m3 bytes to float16 (exact), two to an instruction, as an asm block the compiler keeps where it stands:
    a conversion it may move is moved past the tile's change of layout to the matrix operand's, where an 8-bit
    value tile, transposed, is gathered from shared memory a byte at a time (on an H200, 64 one-byte loads and
    32 packing multiply-adds a thread for a 128 x 128 tile, where float16 moves as ldmatrix's 16-bit rows)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def attend_loaded(q, acc, l_i, m_i, k, v, pos, in_range, q_pos, qk_scale, MASK: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, ASM: tl.constexpr = False):
    """One online-softmax step of q [M, D] over a tile load_kv_tile loaded.

    Scores are in log2 units (qk_scale includes log2(e), and an FP8 cache's key scale); acc sums the values as
    stored (the caller multiplies by the value scale). MASK: 0 = the whole tile is visible to every row
    (caller's guarantee), 1 = positions outside the tile's range are hidden, 2 = also hide positions after
    q_pos[r] from row r (causal).
    Invariant: a row that has seen no visible position keeps m_i = -inf, l_i = 0 and acc = 0, with no NaN (so a
    tile whose range is empty leaves the statistics as they were).
    ASM (a GPU): an FP8 tile's values convert to float16 q by _fp8_to_f16 (the same numbers).
    """
    k = k.to(q.dtype)  # a cache in another dtype (FP8: exact); its scale is in qk_scale
    if ASM and v.dtype == tl.float8e4nv and q.dtype == tl.float16:
        v = _fp8_to_f16(v)
    else:
        v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASK == 1:
        qk = tl.where(in_range[None, :], qk, float("-inf"))
    elif MASK == 2:
        qk = tl.where(in_range[None, :] & (pos[None, :] <= q_pos[:, None]), qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) would be NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def attend_tile(q, acc, l_i, m_i, k_base, v_base, table_row, stride_s, start, end, q_pos, qk_scale,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, ASM: tl.constexpr = False):
    """One online-softmax step of q [M, D] over positions [start, start + BLOCK_N) clipped to `end`: the tile
    loaded (load_kv_tile) and attended (attend_loaded)."""
    k, v, pos, in_range = load_kv_tile(k_base, v_base, table_row, stride_s, start, end, BLOCK_N, BLOCK_SIZE,
                                       HEAD_DIM)
    return attend_loaded(q, acc, l_i, m_i, k, v, pos, in_range, q_pos, qk_scale, MASK, DOT_PRECISION, ASM)


# ---------------------------------------------------------------------------------------------------------------
# Prefill: several query tokens per sequence, causal


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr,
                    context_lens_ptr, qk_scale, v_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_bt,
                    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (reversed m_block, seq, head): query rows [m_block * BLOCK_M, +BLOCK_M) of seq, one head.

    Row j of seq sits at position context - q_len + j and sees every position up to its own. KV tiles that
    end at or before the first row's position need no causal mask; the rest, up to the last row's position,
    are masked.
    """
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows (most KV tiles) start first
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    context = tl.load(context_lens_ptr + seq)
    first_pos = context - q_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = first_pos + rows
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    kv_head = head // GROUP
    k_base = k_cache_ptr + kv_head * stride_kch
    v_base = v_cache_ptr + kv_head * stride_vch
    table_row = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    first_row_pos = first_pos + m_block * BLOCK_M
    full_end = (first_row_pos + 1) // BLOCK_N * BLOCK_N  # tiles below this are visible to every row
    causal_end = first_pos + tl.minimum((m_block + 1) * BLOCK_M, q_len)  # last row's position + 1
    for start in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(q, acc, l_i, m_i, k_base, v_base, table_row, stride_kcs, start, full_end,
                                    q_pos, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD_DIM, 0, DOT_PRECISION)
    for start in range(full_end, causal_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(q, acc, l_i, m_i, k_base, v_base, table_row, stride_kcs, start, causal_end,
                                    q_pos, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD_DIM, 2, DOT_PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale  # x 1.0 (16-bit caches) keeps every bit
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                            max_query_len: int, scale: float, block_size: int,
                            out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0
                            ) -> torch.Tensor:
    """Causal attention for sequences that compute several tokens this step, reading keys/values from the cache.

    q: [T, num_heads, head_dim] (any strides, unit last-dim stride); rows of sequence i are
    [query_start[i], query_start[i + 1]) (int32, [num_seqs + 1]). context_lens[i] counts the cached positions
    of sequence i including this step's tokens (already stored), so its row j sits at position
    context_lens[i] - q_len_i + j. max_query_len (>= every q_len_i) only sizes the grid
    (cdiv(max_query_len, BLOCK_M), num_seqs, num_heads). Returns [T, num_heads, head_dim] in q's dtype, written
    into `out` if given; rows not covered by query_start are left untouched. k_scale, v_scale: an FP8 cache's
    (stored * scale is read).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_seqs = query_start.shape[0] - 1
    check_attention_args(q, k_cache, v_cache, block_size)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs <= 0 or max_query_len <= 0:
        return out
    config = _prefill_config(head_dim, q.dtype)
    grid = (triton.cdiv(max_query_len, config["BLOCK_M"]), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(q.dtype), **config)
    return out
