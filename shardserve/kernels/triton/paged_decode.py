"""Decode attention over the paged KV cache as Triton kernels: one query token per sequence, split-K over the
context (flash-decoding), the splits joined in the same launch or by a second one, and in a decode-only step the
new token's head norms, rotation and cache write inside the same launch (NewTokens).

Cache layout and numerics: shardserve/kernels/triton/paged_attention.py. Every launch depends only on tensor
shapes and Python ints, never on tensor contents, so decode can be captured in a CUDA graph: sequence lengths
are read inside the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shardserve import envs
from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.arrivals import arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.fused_ops import (check_norm_args, normed_heads, rotary_tables, rotate_rows,
                                                 sigmoid_gated_values)
from shardserve.kernels.triton.paged_attention import (LOG2E, attend_loaded, attend_tile, cache_values,
                                                       check_attention_args, dot_precision, is_fp8_cache,
                                                       load_kv_tile, tile_operand)
from shardserve.kernels.triton.pdl import enter, launch_next


# FP8 caches' decode tiles, measured on an H200 (benchmarks/paged_decode.py: batch 64 over 8,192-token contexts,
# Llama-3-8B's heads, us a layer without / with the new token's rotation at eight warps; the bfloat16 cache:
# 477 / 570): 128-token tiles 370 / 422, 64-token 605 / 570; two stages instead of three 413 / 435 (four: as
# three); eight warps without the rotation 408; the values converted where the compiler moves the conversion (no
# asm) 463 / 648. The FP8 kernel before (bfloat16 conversions, 64-token tiles): 610 / 662.


def _decode_config(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> dict:
    """Launch parameters of the decode kernel over a cache of `cache_dtype` (default: q's `dtype`).

    16-bit and float32 caches: KV tiles of 64 tokens (32 where a row of q's dtype is over 512 bytes), three tiles
    in flight where rows are small enough for that to fit in shared memory. FP8 caches: tiles of 128 tokens where
    a row is 128 bytes or less (64 over), the bytes a 16-bit tile of 64 moves: a program waits for one tile an
    iteration, so tiles of the 16-bit cache's tokens bring half its bytes a wait (measured: the comment above)."""
    if cache_dtype is not None and cache_dtype == torch.float8_e4m3fn:
        return dict(BLOCK_N=128 if head_dim <= 128 else 64, num_warps=4, num_stages=3)
    row_bytes = head_dim * torch.finfo(dtype).bits // 8
    return dict(BLOCK_N=64 if row_bytes <= 512 else 32, num_warps=4, num_stages=3 if row_bytes <= 256 else 2)


@triton.jit
def _attend_one(q, acc, l_i, m_i, k, v, qk_scale):
    """The online-softmax step of q [M, D] over one position whose key and value, [1, D], are in registers
    (decode's new token, not read back from the cache it is being written to). As attend_tile computes a
    tile, with the products summed in float32 in another order."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * qk_scale
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)  # m_new is finite: no NaN
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + p
    p = p.to(v.dtype).to(tl.float32)  # rounded as the tile rounds the weights before they multiply V
    acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
    return acc, l_i, m_new


COMBINE_MODES = envs.DECODE_COMBINE.choices
# The last program of a fused combine joins every split of its KV head's whole group of query heads alone: past
# this many (query head, split) rows that costs more than the launch it saves. On an H100, batch 1, a layer
# (groups of 4): 7.75 -> 7.54 us fused at 2 splits, 8.32 -> 7.72 at 4, 8.93 -> 9.53 at 16, 28.4 -> 29.0 at 32; whole
# decode graphs at 8 splits: Llama-3-8B's shape (groups of 4) 5.484 -> 5.440 ms, Qwen3-30B-A3B's (groups of 8)
# 3.175 -> 3.218 ms.
FUSED_COMBINE_MAX_ROWS = 32


def combine_mode() -> str:
    """How decode with several splits joins them: "fused", the last split program of each (sequence, KV head) to
    finish combines them in the same launch (up to FUSED_COMBINE_MAX_ROWS query heads x splits), or "separate", a
    second kernel does (the same bits, one more launch). SHARDSERVE_DECODE_COMBINE, default "fused"."""
    return envs.DECODE_COMBINE.get()


# Warps of a decode launch that rotates and stores its new token: four spill registers once the rotation is in
# (sm_90: 255 registers and 144-200 bytes of stack; eight: ~207, none). On an H100, us a layer of a 32-layer
# batch-1 chain (benchmarks/decode_attention_chain.py) against the rotary kernel + four-warp decode, at contexts
# 300 / 1,800 / 6,000: Llama-3-8B's heads 37.02 / 42.69 / 46.18 -> 36.75 / 43.10 / 45.79 (four warps: 38.51 /
# 45.24 / 45.88); Qwen3-30B-A3B's 23.00 / 28.22 / 29.51 -> 22.47 / 28.20 / 28.38 (24.49 / 30.98 / 29.84).
DECODE_NEW_TOKEN_WARPS = 8
# FP8 caches at one split per sequence (large batches) keep _decode_config's four: the 128-token tiles need no
# stack there (sm_90: about 200 registers). On an H200, batch 64 over 8,192-token contexts, Llama-3-8B's heads:
# 390 against 422 us a layer.
ROTARY_MODES = envs.DECODE_ROTARY.choices


def rotary_mode() -> str:
    """Where a decode-only step normalises and rotates its heads and writes its keys and values: "fused", inside
    the decode launch (NewTokens), or "separate", in the rotary kernel launched before it (the same numbers, one
    launch more a layer). SHARDSERVE_DECODE_ROTARY, default "fused"."""
    return envs.DECODE_ROTARY.get()


@triton.jit
def _store_heads(out_ptrs, out, mask, gate_ptrs, GATE: tl.constexpr):
    """Store float32 head rows `out` in the output's dtype; with GATE times sigmoid(gate) rounded as
    layers.attention.sigmoid_gated rounds it (the output rounded first, then fused_ops.sigmoid_gated_values: the
    sigmoid gate kernel's bits)."""
    out = out.to(out_ptrs.dtype.element_ty)
    if GATE:
        out = sigmoid_gated_values(out, tl.load(gate_ptrs, mask=mask, other=0.0))
    tl.store(out_ptrs, out, mask=mask)


@triton.jit
def _combine_splits(partial_ptr, lse_ptr, out_ptr, b, first_head, heads, num_splits,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                    gate_ptr, stride_gb, stride_gh, HEADS_P: tl.constexpr, SPLITS_P: tl.constexpr,
                    HEAD_DIM: tl.constexpr, LOAD_CACHE: tl.constexpr, GATE: tl.constexpr = False):
    """out[b, h] = sum_s w_s * partial_s / sum_s w_s with w_s = 2^(lse_s - max lse) for the `heads` heads from
    first_head; 0 where every split is empty; with GATE times sigmoid(gate[b, h]) (_store_heads).

    Each element is summed in split order, one split after another, so the bits do not depend on how the
    compiler lays the tile out over threads: any number of heads per program gives the same result. Every split
    below num_splits was written (zeros where its range is empty), so no load waits for the lse values, and all
    of them are in flight at once. LOAD_CACHE ".cg": written by other programs of this launch, so the loads
    skip this SM's L1.
    """
    rows = tl.arange(0, HEADS_P)
    row_ok = rows < heads
    head = first_head + rows
    dims = tl.arange(0, HEAD_DIM)
    lse_rows = lse_ptr + b * stride_lb + head * stride_lh
    part_rows = partial_ptr + b * stride_pb + head[:, None] * stride_ph + dims[None, :]
    splits = tl.arange(0, SPLITS_P)
    lse = tl.load(lse_rows[:, None] + splits[None, :], mask=row_ok[:, None] & (splits < num_splits)[None, :],
                  other=float("-inf"), cache_modifier=LOAD_CACHE)
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([HEADS_P], dtype=tl.float32)
    acc = tl.zeros([HEADS_P, HEAD_DIM], dtype=tl.float32)
    for s in tl.static_range(SPLITS_P):
        ok = row_ok & (s < num_splits)
        w = tl.exp2(tl.load(lse_rows + s, mask=ok, other=float("-inf"), cache_modifier=LOAD_CACHE) - m)
        part = tl.load(part_rows + s * stride_ps, mask=ok[:, None], other=0.0, cache_modifier=LOAD_CACHE)
        total += w
        acc += part * w[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    _store_heads(out_ptr + b * stride_ob + head[:, None] * stride_oh + dims[None, :], out, row_ok[:, None],
                 gate_ptr + b * stride_gb + head[:, None] * stride_gh + dims[None, :], GATE)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, block_tables_ptr, context_lens_ptr,
                   qk_scale, k_scale, v_scale, num_splits,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   stride_kcs, stride_kch, stride_vcs, stride_vch, stride_bt,
                   final_ptr, arrivals_ptr, stride_fb, stride_fh, gate_ptr, stride_gb, stride_gh,
                   k_new_ptr, v_new_ptr, slot_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
                   stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cos, stride_sin,
                   GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr, GROUP_C: tl.constexpr,
                   SPLITS_P: tl.constexpr, DOT_PRECISION: tl.constexpr, ROTATE: tl.constexpr, NORM: tl.constexpr,
                   PRELOAD_KV: tl.constexpr, PDL: tl.constexpr, KV_FP8: tl.constexpr = False,
                   NEXT_EARLY: tl.constexpr = False, ASM: tl.constexpr = False, ROTARY_DIM: tl.constexpr = 0,
                   GATE: tl.constexpr = False):
    """Program (b, kv_head, split): every query head of the KV-head group over one contiguous share of b's context.

    The context [0, context_lens[b]) is cut into num_splits ranges of equal length, a multiple of BLOCK_SIZE
    (the last ones shorter or empty). With SPLIT, writes the normalised partial output (float32) at
    [b, head, split] and its log2-sum-exp (-inf when the range is empty); otherwise writes the final output.
    COMBINE (with SPLIT): each program then counts itself in arrivals[b * num_kv_heads + kv_head]
    (kernels/triton/arrivals.py); the last of the num_splits to arrive sees every split's stores, combines them
    into final[b, head] for the group's heads (GROUP_C: GROUP to a power of two) as _combine_splits_kernel
    does (the same bits, where both are compiled alike: not so with ROTATE, which turns off multiply-add
    contraction), and puts the count back to 0 for the next launch.
    ROTATE: the query heads at q_ptr and this step's keys at k_new_ptr are not yet normalised (NORM: Qwen3's head
    norms, q_norm_ptr / k_norm_ptr) nor rotated (cos/sin at the new token's position, context - 1; ROTARY_DIM:
    tables that rotate only each head's first ROTARY_DIM dims, Qwen3-Next's partial rotation). Every
    program normalises and rotates its group's query heads itself; the one whose range holds the new token does
    the same to its KV head's key, stores it and v_new's row in the cache at slot_ptr[b] (negative: not
    stored), and attends to them last, from registers (_attend_one), so no launch for the cache write precedes
    attention. The cache gets the bits _rotary_store_kernel writes (without multiply-add contraction; with
    NORM up to the order of the sum of squares); attention agrees with the two launches to rounding.
    PDL: launched to overlap the kernel before it (kernels/triton/pdl.py); the counts are touched after the
    wait, and only by this kernel's programs. PRELOAD_KV (with ROTATE): what no kernel of the step's chain writes
    is read before the wait: the step's inputs (context lengths, slots, block tables), the rotary tables and the
    first tile of cached keys and values (the tile a split of a short context is made of). NEXT_EARLY: the next
    kernel (the combine, the o projection) launches at this one's start (pdl.launch_next).
    GATE: the final output is multiplied by sigmoid(gate[b, head]) as it is stored (gated attention, _store_heads).
    KV_FP8: the caches hold e4m3 (k_scale is in qk_scale; the output is multiplied by v_scale); with 16-bit q the
    tiles are multiplied in float16 (paged_attention.tile_operand), with ASM (a GPU) converted by
    paged_attention._fp8_to_f16.
    """
    if NEXT_EARLY:
        launch_next(PDL)
    if not (ROTATE and PRELOAD_KV):
        # Without ROTATE the kernel before may have written this step's keys and values to the cache.
        enter(PDL, NEXT_EARLY)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + b)  # with PRELOAD_KV before the wait: a step input, written before the chain
    per_split = tl.cdiv(tl.cdiv(context, BLOCK_SIZE), num_splits) * BLOCK_SIZE
    lo = split * per_split
    hi = tl.minimum(lo + per_split, context)

    rows = tl.arange(0, GROUP_P)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    k_base = k_cache_ptr + kv_head * stride_kch
    v_base = v_cache_ptr + kv_head * stride_vch
    table_row = block_tables_ptr + b * stride_bt
    q_rows = q_ptr + b * stride_qb + heads * stride_qh
    m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], dtype=tl.float32)
    if ROTATE:
        new_slot = tl.load(slot_ptr + b).to(tl.int64)
        new_pos = context - 1
        pos = tl.maximum(new_pos, 0).to(tl.int64)  # a padding row (context 0) reads position 0's table
        cos, sin = rotary_tables(cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, HEAD_DIM, ROTARY_DIM)
        holds_new = (new_pos >= lo) & (new_pos < hi)  # at most one program of (b, kv_head)
        cached_end = tl.where(holds_new, new_pos, hi)  # the new token is attended from registers, last
        if PRELOAD_KV:
            # Positions before the new token were cached by earlier steps, which no kernel of this step's chain
            # writes: the first tile is loaded before the wait, while the kernel before (q/k/v's GEMV) runs.
            first_k, first_v, first_pos, first_ok = load_kv_tile(k_base, v_base, table_row, stride_kcs, lo,
                                                                 cached_end, BLOCK_N, BLOCK_SIZE, HEAD_DIM)
            enter(PDL, NEXT_EARLY)
        q, q_rolled = normed_heads(q_rows, row_ok, q_norm_ptr, eps, HEAD_DIM, NORM, ROTARY_DIM)
        q = rotate_rows(q, q_rolled, cos, sin)
        q_tile, qk_tile = tile_operand(q, qk_scale, KV_FP8)
        one = tl.zeros([1], dtype=tl.int64)  # the new key as a one-row block; holds_new | (one < 0): its mask
        new_k, new_k_rolled = normed_heads(k_new_ptr + b * stride_knb + kv_head * stride_knh + one,
                                           holds_new | (one < 0), k_norm_ptr, eps, HEAD_DIM, NORM, ROTARY_DIM)
        # The new key and value as the cache holds them (an FP8 cache: quantized), stored and attended so.
        new_k = cache_values(rotate_rows(new_k, new_k_rolled, cos, sin), k_scale, k_cache_ptr, KV_FP8)
        new_v = cache_values(tl.load(v_new_ptr + b * stride_vnb + kv_head * stride_vnh + one[:, None] + dims[None, :],
                                     mask=holds_new, other=0.0), v_scale, v_cache_ptr, KV_FP8)
        stored = holds_new & (new_slot >= 0)
        tl.store(k_base + new_slot * stride_kcs + one[:, None] + dims[None, :], new_k, mask=stored)
        tl.store(v_base + new_slot * stride_vcs + one[:, None] + dims[None, :], new_v, mask=stored)
        if PRELOAD_KV:
            # an empty range leaves the statistics as they were
            acc, l_i, m_i = attend_loaded(q_tile, acc, l_i, m_i, first_k, first_v, first_pos, first_ok, rows,
                                          qk_tile, 1, DOT_PRECISION, ASM)
        for start in range(lo + BLOCK_N if PRELOAD_KV else lo, cached_end, BLOCK_N):
            acc, l_i, m_i = attend_tile(q_tile, acc, l_i, m_i, k_base, v_base, table_row, stride_kcs, start,
                                        cached_end, rows, qk_tile, BLOCK_N, BLOCK_SIZE, HEAD_DIM, 1, DOT_PRECISION,
                                        ASM)
        if holds_new:
            # The weight rounded as the tiles round theirs (to q_tile's dtype: float16 over an FP8 cache).
            acc, l_i, m_i = _attend_one(q, acc, l_i, m_i, new_k.to(q.dtype), new_v.to(q_tile.dtype), qk_scale)
    else:
        q = tl.load(q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        q_tile, qk_tile = tile_operand(q, qk_scale, KV_FP8)
        for start in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = attend_tile(q_tile, acc, l_i, m_i, k_base, v_base, table_row, stride_kcs, start, hi,
                                        rows, qk_tile, BLOCK_N, BLOCK_SIZE, HEAD_DIM, 1, DOT_PRECISION, ASM)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale  # zeros for an empty range
    if SPLIT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)
        if COMBINE:
            slot = b * tl.num_programs(1) + kv_head
            if last_to_arrive(arrivals_ptr, slot, num_splits):
                _combine_splits(out_ptr, lse_ptr, final_ptr, b, kv_head * GROUP, GROUP, num_splits,
                                stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
                                gate_ptr, stride_gb, stride_gh, GROUP_C, SPLITS_P, HEAD_DIM, ".cg", GATE)
                leave(arrivals_ptr, slot)
    else:
        _store_heads(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :], out, row_ok[:, None],
                     gate_ptr + b * stride_gb + heads[:, None] * stride_gh + dims[None, :], GATE)


@triton.jit
def _combine_splits_kernel(partial_ptr, lse_ptr, out_ptr, num_splits,
                           stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                           gate_ptr, stride_gb, stride_gh, SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                           PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False, GATE: tl.constexpr = False):
    """Program (b, head): out[b, head] from its splits (_combine_splits); NEXT_EARLY and GATE as in
    _decode_kernel."""
    if NEXT_EARLY:
        launch_next(PDL)
    enter(PDL, NEXT_EARLY)
    _combine_splits(partial_ptr, lse_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), 1, num_splits,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, gate_ptr,
                    stride_gb, stride_gh, 1, SPLITS_P, HEAD_DIM, "", GATE)


def choose_num_splits(batch_size: int, num_kv_heads: int, max_context: int, num_sms: int = 132,
                      block_size: int = 16) -> int:
    """Splits of the context for decode: about two programs per SM when batch * kv_heads is small, 1 when large.

    Capped so that a split of max_context covers at least ~256 tokens (and at least one block), and at 32.
    """
    programs = max(1, batch_size * num_kv_heads)
    wanted = triton.cdiv(2 * num_sms, programs)
    by_length = max(1, max_context // max(256, block_size))
    return int(max(1, min(wanted, by_length, 32)))


@dataclass(frozen=True)
class NewTokens:
    """A decode step's own keys and values, for the decode launch to store before it attends.

    keys and values: [B, num_kv_heads, head_dim] (strided views allowed, unit last-dim stride), the keys (like the
    query) not yet normalised nor rotated, at position context_lens[b] - 1 (decode's invariant); slots [B]
    (int32/int64; a negative slot is not stored); cos and signed_sin: the tables of
    shardserve.layers.rotary.RotaryEmbedding, head_dim wide or narrower (an even width: only each head's first
    dims are rotated, as RotaryLookup.apply rotates them); head_norm: (query weight, key weight, eps) for Qwen3's
    per-head norms, or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    signed_sin: torch.Tensor
    head_norm: tuple | None = None

    def check(self, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        batch, num_kv_heads, head_dim = q.shape[0], k_cache.shape[1], q.shape[2]
        for name in ("keys", "values"):
            t = getattr(self, name)
            if t.shape != (batch, num_kv_heads, head_dim) or t.stride(-1) != 1 or t.dtype != q.dtype:
                raise ValueError(f"new {name}: {tuple(t.shape)} {t.dtype}; decode of this batch needs "
                                 f"{(batch, num_kv_heads, head_dim)} {q.dtype} with unit last-dim stride")
        for name in ("cos", "signed_sin"):
            t = getattr(self, name)
            width = t.shape[-1]
            if not 0 < width <= head_dim or width % 2 or t.stride(-1) != 1 or t.dtype != q.dtype:
                raise ValueError(f"rotary table {name}: {tuple(t.shape)} {t.dtype}; needs rows of an even width "
                                 f"up to {head_dim}, {q.dtype} with unit stride")
        if self.head_norm is not None:
            for weight in self.head_norm[:2]:
                check_norm_args(q, weight)

    def rotary_dim(self, head_dim: int) -> int:
        """The kernel's ROTARY_DIM: the tables' width where they rotate part of a head, else 0."""
        width = self.cos.shape[-1]
        return width if width < head_dim else 0

    def kernel_args(self) -> tuple:
        q_weight, k_weight, eps = self.head_norm if self.head_norm is not None else (self.keys, self.keys, 0.0)
        return (self.keys, self.values, self.slots, self.cos, self.signed_sin, q_weight, k_weight,
                eps, self.keys.stride(0), self.keys.stride(1), self.values.stride(0), self.values.stride(1),
                self.cos.stride(0), self.signed_sin.stride(0))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, block_size: int,
                           num_splits: int, out: torch.Tensor | None = None,
                           arrivals: torch.Tensor | None = None, new_tokens: NewTokens | None = None,
                           next_early: bool = False, k_scale: float = 1.0, v_scale: float = 1.0,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context (flash-decoding).

    q: [B, num_heads, head_dim] (any strides, unit last-dim stride). Sequence b attends to positions
    [0, context_lens[b]) (int32), its own key/value already stored at context_lens[b] - 1, or, with
    `new_tokens`, stored by this launch (q and the keys are then normalised and rotated here: one launch where
    apply_rotary_and_store_ and this would take two; the same cache, the same output to rounding); a row with
    context_lens[b] == 0 gets zeros. Returns [B, num_heads, head_dim] in q's dtype, written into `out` if given.
    Launch: grid (B, num_kv_heads, num_splits). With num_splits > 1 the splits write a float32 workspace
    [B, num_heads, num_splits, head_dim] allocated here, joined as combine_mode() says: in the same launch (up to
    FUSED_COMBINE_MAX_ROWS query heads of a group x splits), counting in `arrivals` (zeroed int32, at least
    B * num_kv_heads, left at zero; default: the device's shared arrival counts), or by a second kernel over
    (B, num_heads), which also serves larger groups x splits and where the shared counts are too few.
    Graph-capturable; a graph keeps the address of the counts, so they must outlive it. `next_early`: the launch
    (and the combine's) lets the next kernel launch at its start (pdl.py's exception: it must read nothing of the
    chain before its wait). k_scale, v_scale: an FP8 cache's (stored * scale is read; the new token is stored
    quantized and attended as stored). gate: [B, num_heads, head_dim] in q's dtype (any strides, unit last-dim
    stride): the output is multiplied by sigmoid(gate) as it is stored, with layers.attention.sigmoid_gated's
    rounding (gated attention's output gate in the same launch).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    check_attention_args(q, k_cache, v_cache, block_size)
    if new_tokens is not None:
        new_tokens.check(q, k_cache)
    if gate is not None and (gate.shape != q.shape or gate.stride(-1) != 1 or gate.dtype != q.dtype):
        raise ValueError(f"gate: {tuple(gate.shape)} {gate.dtype}; needs {tuple(q.shape)} {q.dtype} with unit "
                         "last-dim stride")
    mode = combine_mode()
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    num_splits = max(1, int(num_splits))
    group = num_heads // num_kv_heads
    fused = mode == "fused" and group * num_splits <= FUSED_COMBINE_MAX_ROWS
    rotate = new_tokens is not None
    kv_fp8 = is_fp8_cache(k_cache)
    config = _decode_config(head_dim, q.dtype, k_cache.dtype)
    if rotate:
        # Without multiply-add contraction the rotation rounds as the rotary kernel does (the cache gets its bits).
        config["enable_fp_fusion"] = False
        if not (kv_fp8 and num_splits == 1):
            config["num_warps"] = DECODE_NEW_TOKEN_WARPS
    common = dict(GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
                  HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype), ROTATE=rotate,
                  # Small batches (several splits): a split is a tile or two, and the wait is on the critical path.
                  # One split per sequence keeps its loop as it was: with the preloaded tile the offline benchmark
                  # (512 sequences) ran 7.6% slower on an H200.
                  PRELOAD_KV=rotate and num_splits > 1,
                  NORM=rotate and new_tokens.head_norm is not None, KV_FP8=kv_fp8, ASM=kv_fp8 and q.is_cuda,
                  ROTARY_DIM=new_tokens.rotary_dim(head_dim) if rotate else 0, GATE=gate is not None,
                  **config, **_launch(q.device, next_early))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                     block_tables.stride(0))
    rotation = new_tokens.kernel_args() if new_tokens is not None else (q,) * 7 + (0.0,) + (0,) * 6
    gating = (q, 0, 0) if gate is None else (gate, gate.stride(0), gate.stride(1))
    grid = (batch, num_kv_heads, num_splits)
    if num_splits == 1:
        _decode_kernel[grid](q, k_cache, v_cache, out, out, block_tables, context_lens, scale * LOG2E * k_scale,
                             k_scale, v_scale, 1,
                             q.stride(0), q.stride(1), out.stride(0), out.stride(1), 0, 0, 0, *cache_strides,
                             out, out, 0, 0, *gating, *rotation, SPLIT=False, COMBINE=False, GROUP_C=1, SPLITS_P=1,
                             **common)
        return out
    partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    counts = _combine_counts(arrivals, batch * num_kv_heads, q.device) if fused else None
    splits_p = triton.next_power_of_2(num_splits)
    _decode_kernel[grid](q, k_cache, v_cache, partial, lse, block_tables, context_lens, scale * LOG2E * k_scale,
                         k_scale, v_scale, num_splits,
                         q.stride(0), q.stride(1), partial.stride(0), partial.stride(1), partial.stride(2),
                         lse.stride(0), lse.stride(1), *cache_strides,
                         out, lse if counts is None else counts, out.stride(0), out.stride(1), *gating, *rotation,
                         SPLIT=True, COMBINE=counts is not None, GROUP_C=triton.next_power_of_2(group),
                         SPLITS_P=1 if counts is None else splits_p, **common)
    if counts is None:
        _combine_splits_kernel[(batch, num_heads)](
            partial, lse, out, num_splits, partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), *gating,
            SPLITS_P=splits_p, HEAD_DIM=head_dim, GATE=gate is not None, num_warps=4 if head_dim <= 128 else 8,
            **_launch(q.device, next_early))
    return out


def _launch(device: torch.device, next_early: bool) -> dict:
    """pdl.launch's arguments, with NEXT_EARLY where attention lets the next kernel launch at its start (the
    caller's `next_early`: the o projection loads its rows meanwhile; layers/attention.overlap_with_o_projection)."""
    launch = pdl.launch(device)
    if launch["PDL"] and next_early and pdl.attention_overlap():
        launch["NEXT_EARLY"] = True
    return launch


def _combine_counts(arrivals: torch.Tensor | None, slots: int, device: torch.device) -> torch.Tensor | None:
    """The counts of a fused combine: `arrivals`, checked, or the device's shared ones; None where those are too
    few (or not made yet inside a CUDA graph capture) and a second kernel combines."""
    if arrivals is None:
        return arrival_counts(device, slots)
    if arrivals.dtype != torch.int32 or arrivals.numel() < slots or arrivals.device != device:
        raise ValueError(f"arrivals: {arrivals.numel()} {arrivals.dtype} counts on {arrivals.device}; decode of "
                         f"this batch needs at least {slots} zeroed int32 counts on {device}")
    return arrivals
