"""The experts of a mixture-of-experts block in four launches or fewer, with no host synchronisation.

out[t] = sum_j weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])), e = ids[t, j].

1. Alignment (one program): the T*k (token, choice) pairs are grouped by expert, in pair order within each
   expert, and each expert's group is padded to a multiple of BLOCK_M with the sentinel T*k. Every block of
   BLOCK_M slots then belongs to one expert, written to `block_expert` (-1 past the last group). For a single
   token the same program first makes the router's choice from the logits (fused_moe_from_logits), and its k
   distinct choices take one block each, in choice order, straight from registers.
2. Grouped GEMM with w13, SwiGLU in its epilogue: program (block, column tile) multiplies its block's token
   rows by the gate and the up tiles of its expert, and stores silu(gate) * up (rounded to x's dtype) per slot.
3. Grouped GEMM with w2: the activations of a block times its expert's w2 tile, scaled by each pair's router
   weight, stored per pair: y [T*k, H].
4. out[t] = sum_j y[t*k + j] in float32, in a fixed order: deterministic. Up to SUM_IN_DOWN_MAX_TOKENS tokens
   the last program of each of step 3's column tiles to finish does it (an arrival count per tile, _down_kernel);
   past that, a kernel of its own. (A w2 GEMM whose programs each walked a single token's k experts for one
   column tile measured slower on an H100: 22.0 against 13.1 us a layer. A GEMM needs its programs spread over
   the experts; only the sum waits for all of them.)

A single token (batch-1 decode) takes matrix-vector products instead (one_token_tiles; SHARDSERVE_MOE_ONE_TOKEN=gemm
keeps the steps above): no alignment and no row block of BLOCK_M slots around its one row. Program (choice j,
feature tile) forms act[j] from its expert's gate and up rows; program (column tile, choice j) forms
y[j] = weight[j] * w2[e] @ act[j] for its columns, and the last of a column tile's k programs to finish sums them
in choice order (as step 4). The w2 programs load their weight rows before waiting for the w13 product (pdl.py:
the expert ids come from the router, two launches back, and weights are written by no kernel).
At batch 1 a layer is then three launches (router choice, w13, w2 + sum) after the router's GEMV, each launched
to overlap the one before it on Hopper (kernels/triton/pdl.py); two where the router's GEMV makes the choice itself
(kernels/triton/router_gemv.py, one_token_experts).
Shapes are fixed for a given T (the slot list has room for the worst case, T*k + min(E, T*k) * (BLOCK_M - 1)
slots; blocks past the real groups exit at once), so CUDA graphs capture the whole call. Only experts that
received tokens are read: decode reads k experts' weights, not E. Block sizes come from a table keyed on the
expected rows per expert (T*k/E): kernels/fused_moe_table.py.
Accumulation is float32 for every input dtype; float32 inputs multiply in full float32 (no TF32).
Non-gated experts (NemotronH's: `activation` "relu2" or "silu", w13 holding only up rows) run the same launches
with the gate's product left out.
Packed experts (FP8 or 4-bit with scales, kernels/packed_experts.py: fused_moe_packed; gated or not) run the same
GEMMs, and a single token the one-token path's products, each weight tile dequantized in registers before its
product, so only the packed bytes are read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve import envs
from shardserve.kernels.fused_moe_table import (ONE_TOKEN_ENV, ROUTE_ALIGN_MAX_TOKENS, SUM_IN_DOWN_MAX_TOKENS,
                                                MoeConfig, OneTokenTiles, one_token_packed_tiles, one_token_tiles,
                                                pick_config)
from shardserve.kernels.packed_experts import PackedExperts
from shardserve.kernels.quant_layout import FOUR_BIT_KINDS
from shardserve.kernels.quant_pack import fit_block_k, scale_dtype
from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.arrivals import arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.gemv import _weight_tile as _row_tile
from shardserve.kernels.triton.gemv import _x_tile, load_first_tiles, row_dots
from shardserve.kernels.triton.l2_prefetch import prefetch_rows, rows_prefetch
from shardserve.kernels.triton.moe_router import route_token, route_top_k, routing_outputs
from shardserve.kernels.triton.pdl import enter
from shardserve.kernels.triton.quant_gemv import (_e4m3_bits_to_float, _native_fp8, _rows_column,
                                                  four_bit_row_scales, four_bit_scale_and_zero,
                                                  nibble_values, row_scale_pointer)


# ---------------------------------------------------------------------------------------------------------------
# Alignment


@triton.jit
def _align(ids_ptr, id_base, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks,
           BLOCK_M: tl.constexpr, EXPERTS_P: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    """Pairs whose id - id_base is outside [0, E) join no group and are never stored.

    Invariant: expert e owns slots [start_e, end_e), end_e - start_e = count_e rounded up to BLOCK_M; its real
    pairs fill [start_e, start_e + count_e) (pass 2) and the sentinel the rest (pass 3). The two passes write
    disjoint slots, so no barrier orders them.
    """
    experts = tl.arange(0, EXPERTS_P)
    pair = tl.arange(0, CHUNK)
    # Pass 1: pairs per expert.
    counts = tl.zeros([EXPERTS_P], dtype=tl.int32)
    for c in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + c + pair, mask=c + pair < num_pairs, other=-1).to(tl.int32) - id_base
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # Pass 2: each pair's slot = its expert's start + pairs of that expert before it.
    seen = starts
    for c in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + c + pair, mask=c + pair < num_pairs, other=-1).to(tl.int32) - id_base
        hit = ((ids[:, None] == experts[None, :]) & (experts < num_experts)[None, :]).to(tl.int32)
        earlier = tl.cumsum(hit, axis=0) - hit  # same expert, earlier in this chunk
        slot = tl.sum(hit * (seen[None, :] + earlier), axis=1)
        tl.store(sorted_ptr + slot, c + pair, mask=tl.sum(hit, axis=1) > 0)
        seen += tl.sum(hit, axis=0)
    # Pass 3: the sentinel in each group's padding (fewer than BLOCK_M slots per expert).
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pad, tl.full(pad.shape, 0, tl.int32) + num_pairs, mask=pad < ends[:, None])
    # The expert of block b is the number of groups that end at or before its first slot.
    total = tl.sum(padded, axis=0)
    for b in range(0, num_blocks, BLOCKS_CHUNK):
        blocks = b + tl.arange(0, BLOCKS_CHUNK)
        first = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first < total, owner, -1), mask=blocks < num_blocks)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks,
                  BLOCK_M: tl.constexpr, EXPERTS_P: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One program. PDL: launched to overlap the kernel before it (kernels/triton/pdl.py), as every kernel here."""
    enter(PDL)
    _align(ids_ptr, 0, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks, BLOCK_M, EXPERTS_P,
           CHUNK, BLOCKS_CHUNK)


@triton.jit
def _align_one_token(ids, id_base, sorted_ptr, block_expert_ptr, num_experts, TOP_K: tl.constexpr,
                     TOP_K_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The alignment of a single token's k distinct choices ([TOP_K_P] expert ids, E >= k so there are k blocks):
    block j holds choice j alone (pair j in its first slot, the sentinel k in the others) and belongs to its
    expert, or to none (-1) where another rank holds it. Any order of the groups serves the GEMMs, and the sum
    of choices runs over pairs, not blocks."""
    choice = tl.arange(0, TOP_K_P)
    expert = ids - id_base
    held = (expert >= 0) & (expert < num_experts)
    tl.store(block_expert_ptr + choice, tl.where(held, expert, -1), mask=choice < TOP_K)
    slot = tl.arange(0, BLOCK_M)
    pair = tl.where(slot[None, :] == 0, choice[:, None], TOP_K)
    tl.store(sorted_ptr + choice[:, None] * BLOCK_M + slot[None, :], pair, mask=(choice < TOP_K)[:, None])


@triton.jit
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_tokens, num_logits,
                        stride_logits, id_base, num_experts, num_blocks, TOP_K: tl.constexpr,
                        TOP_K_P: tl.constexpr, LOGITS_P: tl.constexpr, RENORMALIZE: tl.constexpr,
                        BLOCK_M: tl.constexpr, EXPERTS_P: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCKS_CHUNK: tl.constexpr, ONE_TOKEN: tl.constexpr, PDL: tl.constexpr):
    """One program: the router's choice for every token (moe_router.route_token), then their alignment. The
    barrier makes the ids this program stored visible to all its threads before they are read back. ONE_TOKEN
    (a single token, E >= k): the alignment from the choices in registers (_align_one_token)."""
    enter(PDL)
    if ONE_TOKEN:
        ids = route_token(logits_ptr, weights_ptr, ids_ptr, 0, num_logits, stride_logits, TOP_K, TOP_K_P, LOGITS_P,
                          RENORMALIZE)
        _align_one_token(ids, id_base, sorted_ptr, block_expert_ptr, num_experts, TOP_K, TOP_K_P, BLOCK_M)
    else:
        for token in range(num_tokens):
            route_token(logits_ptr, weights_ptr, ids_ptr, token, num_logits, stride_logits, TOP_K, TOP_K_P,
                        LOGITS_P, RENORMALIZE)
        tl.debug_barrier()
        _align(ids_ptr, id_base, sorted_ptr, block_expert_ptr, num_tokens * TOP_K, num_experts, num_blocks,
               BLOCK_M, EXPERTS_P, CHUNK, BLOCKS_CHUNK)


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks in the worst case: every expert that can receive a pair leaves BLOCK_M - 1 slots of padding."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def _alignment_buffers(pairs: int, num_experts: int, block_m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = num_blocks(pairs, num_experts, block_m)
    return (torch.empty(blocks * block_m, dtype=torch.int32, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device))


def _alignment_meta(pairs: int, num_experts: int, blocks: int) -> dict:
    """The alignment's chunk sizes and warps (its registers hold a chunk x experts table)."""
    experts_p = triton.next_power_of_2(num_experts)
    return dict(EXPERTS_P=experts_p, CHUNK=min(triton.next_power_of_2(pairs), max(16, 8192 // experts_p)),
                BLOCKS_CHUNK=min(triton.next_power_of_2(blocks), max(16, 8192 // experts_p)),
                num_warps=4 if pairs * experts_p <= 1 << 16 else 8)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [blocks * block_m] int32, block_expert [blocks] int32) for topk_ids [T, k].

    sorted_pairs holds pair indices t * k + j grouped by expert (ascending within a group), each group padded to
    a multiple of block_m with T * k; slots past the last group are left unset. block_expert[b] is the expert
    of slots [b * block_m, (b + 1) * block_m), or -1 past the last group.
    """
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    pairs = ids.numel()
    if pairs * triton.next_power_of_2(num_experts) > ALIGN_IN_ONE_PROGRAM_MAX:
        return align_pairs_by_sort(ids, num_experts, block_m)
    sorted_pairs, block_expert = _alignment_buffers(pairs, num_experts, block_m, ids.device)
    blocks = block_expert.numel()
    _align_kernel[(1,)](ids, sorted_pairs, block_expert, pairs, num_experts, blocks, BLOCK_M=block_m,
                        **_alignment_meta(pairs, num_experts, blocks), **pdl.launch(ids.device))
    return sorted_pairs, block_expert


# Past this many (pair, expert) comparisons the one-program alignment gives way to align_pairs_by_sort: the program
# compares every pair with every expert on one SM, which took 43 ms a layer for a prefill chunk of 8,192 tokens at
# Qwen3-Next's 512 (+1) experts and top 10 (+1) on an H200, most of its prompt's prefill.
ALIGN_IN_ONE_PROGRAM_MAX = 1 << 22


def align_pairs_by_sort(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_pairs's result through torch's device sort and scans, for many pairs: every shape fixed by the pair
    count and no host synchronisation (counts by scatter_add, not bincount), so CUDA graphs capture it. Slots past
    the last group hold the sentinel."""
    pairs, device = ids.numel(), ids.device
    blocks = num_blocks(pairs, num_experts, block_m)
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(torch.int64)  # others: one last group
    sorted_key, order = torch.sort(key, stable=True)  # pairs grouped by expert, in pair order within each group
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts, group_first = ends - padded, torch.cumsum(counts, 0) - counts
    held = sorted_key < num_experts
    expert = sorted_key.clamp(max=num_experts - 1)
    position = torch.arange(pairs, device=device)
    trash = blocks * block_m  # one slot past the buffer's end takes the pairs of no group
    slot = torch.where(held, starts[expert] + position - group_first[expert], trash)
    sorted_pairs = torch.full((blocks * block_m + 1,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    first = torch.arange(blocks, device=device) * block_m
    owner = torch.searchsorted(ends, first, right=True)  # groups that end at or before the block's first slot
    block_expert = torch.where(first < ends[-1], owner, -1).to(torch.int32)
    return sorted_pairs[:-1], block_expert


def route_and_align(logits: torch.Tensor, top_k: int, renormalize: bool, num_experts: int, block_m: int,
                    id_base: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64, sorted_pairs, block_expert) in one launch: route_top_k of the
    logits [T, E_all], then align_pairs of ids - id_base over num_experts experts (this rank's, from id_base)."""
    tokens, num_logits = logits.shape
    logits, weights, ids = routing_outputs(logits, top_k)
    pairs = tokens * top_k
    sorted_pairs, block_expert = _alignment_buffers(pairs, num_experts, block_m, logits.device)
    blocks = block_expert.numel()
    meta = _alignment_meta(pairs, num_experts, blocks)
    if pairs * meta["EXPERTS_P"] <= 1 << 12:
        # One warp: the router's k rounds of reductions over the experts stay within the warp (shuffles). With
        # four, each crosses warps through shared memory, and the launch took longer than the two it replaced.
        meta["num_warps"] = 1
    _route_align_kernel[(1,)](logits, weights, ids, sorted_pairs, block_expert, tokens, num_logits,
                              logits.stride(0), id_base, num_experts, blocks, TOP_K=top_k,
                              TOP_K_P=triton.next_power_of_2(top_k), LOGITS_P=triton.next_power_of_2(num_logits),
                              RENORMALIZE=renormalize, BLOCK_M=block_m, ONE_TOKEN=tokens == 1 and num_experts >= top_k,
                              **meta, **pdl.launch(logits.device))
    return weights, ids, sorted_pairs, block_expert


# ---------------------------------------------------------------------------------------------------------------
# Grouped GEMMs


# Weight kinds (the KIND constexpr): the compute dtype as it is, or packed (kernels/packed_experts.py) and
# dequantized tile by tile in registers, each weight in float32 then rounded once to the activations' dtype.
# FP4 reads INT4's tiles with the e2m1 decode table (quant_gemv.nibble_values, four_bit_scale_and_zero).
DENSE, FP8, INT4, FP4 = 0, 1, 2, 3


@triton.jit
def _weight_tile(w_ptr, s_ptr, r_ptr, feats, feat_ok, k, stride_wn, stride_sn, K: tl.constexpr, KIND: tl.constexpr,
                 GROUP: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 DTYPE: tl.constexpr):
    """[BLOCK_K, BLOCK_N]: columns k..k + BLOCK_K of one expert's weight rows `feats`, in DTYPE. Packed tiles lie
    inside one scale group (BLOCK_K divides GROUP, or GROUP is K), so each row takes one scale (and zero) a tile:
    FP8 scales, int4 scale-and-zero words (quant_gemv.scale_and_zero), or fp4's e4m3 bytes times the row's scale
    (r_ptr: the expert's row scales, read for fp4 only); a 4-bit tile may instead span whole groups (GROUP divides
    BLOCK_K: _packed_block_k), each with its own scale.
    Columns past K load as 0 (their activations are 0 too)."""
    ks = tl.arange(0, BLOCK_K)
    if KIND == 0:
        mask = feat_ok[None, :] if K % BLOCK_K == 0 else feat_ok[None, :] & (k + ks < K)[:, None]
        w = tl.load(w_ptr + feats[None, :] * stride_wn + (k + ks)[:, None], mask=mask, other=0.0)
    else:
        if (GROUP < BLOCK_K) and (GROUP < K):  # 4-bit only: [BLOCK_N, groups of the tile]
            groups = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
            s = tl.load(s_ptr + feats[:, None] * stride_sn + groups[None, :],
                        mask=feat_ok[:, None] & (groups < (K + GROUP - 1) // GROUP)[None, :], other=0)
        else:
            s = tl.load(s_ptr + feats * stride_sn + k // GROUP, mask=feat_ok, other=0)  # int4: scale-and-zero words
        if KIND == 1:
            mask = feat_ok[:, None] if K % BLOCK_K == 0 else feat_ok[:, None] & (k + ks < K)[None, :]
            bits = tl.load(w_ptr + feats[:, None] * stride_wn + (k + ks)[None, :], mask=mask, other=0)
            if NATIVE_FP8:
                v = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]
            else:
                v = _e4m3_bits_to_float(bits) * (s * 256.0)[:, None]  # decoded to value / 256
        else:
            byte = tl.arange(0, BLOCK_K // 2)
            mask = feat_ok[:, None] if K % BLOCK_K == 0 else feat_ok[:, None] & (k // 2 + byte < K // 2)[None, :]
            b = tl.load(w_ptr + feats[:, None] * stride_wn + (k // 2 + byte)[None, :], mask=mask, other=0)
            b = b.to(tl.int32)
            q = tl.join(nibble_values(b & 15, KIND == 3), nibble_values(b >> 4, KIND == 3)).reshape(BLOCK_N, BLOCK_K)
            row_scale = four_bit_row_scales(r_ptr, feats, feat_ok, KIND == 3)
            if (GROUP < BLOCK_K) and (GROUP < K):
                s, z = four_bit_scale_and_zero(s, KIND == 3, _rows_column(row_scale, KIND == 3))
                v = ((q.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP) - z[:, :, None]) * s[:, :, None]).reshape(
                    BLOCK_N, BLOCK_K)
            else:
                s, z = four_bit_scale_and_zero(s, KIND == 3, row_scale)
                v = (q - z[:, None]) * s[:, None]
        w = tl.trans(v.to(DTYPE))
    return w


@triton.jit
def _expert_rows(r_ptr, e, stride_se, stride_sn, KIND: tl.constexpr):
    """fp4's row scales of expert e ([E, rows], contiguous as the scales [E, rows, groups] are: _packed_args); r_ptr
    itself (never read) for other kinds."""
    if KIND == 3:
        rows = r_ptr + e * (stride_se // stride_sn)
    else:
        rows = r_ptr
    return rows


# Activations (the ACT constexpr): SwiGLU experts hold gate and up rows in w13 [E, 2I, H]; non-gated experts
# (NemotronH's) hold only up rows, w1 [E, I, H], and apply the squared ReLU or SiLU to them.
ACTIVATIONS = {"swiglu": 0, "relu2": 1, "silu": 2}


@triton.jit
def _activate(gate, up, ACT: tl.constexpr):
    """The expert's activation in float32: silu(gate) * up (SwiGLU), relu(up)^2, or silu(up) (gate unused)."""
    if ACT == 0:
        return gate / (1.0 + tl.exp(-gate)) * up
    elif ACT == 1:
        r = tl.maximum(up, 0.0)
        return r * r
    else:
        return up / (1.0 + tl.exp(-up))


@triton.jit
def _up_swiglu_kernel(x_ptr, w_ptr, s_ptr, r_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k,
                      stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_a,
                      HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                      NATIVE_FP8: tl.constexpr, PDL: tl.constexpr, ACT: tl.constexpr = 0):
    """Program (block, column tile): act[slot, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for
    the block's slots (padding rows compute zeros from masked loads and are not stored); non-gated (ACT 1, 2):
    act(x[token] . w1[e, n]). Packed weights: s holds the scales (int4: scale-and-zero words) [E, 2I, groups] (the
    gate's and the up rows' own), r fp4's row scales [E, 2I]."""
    enter(PDL)
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + slots)
    row_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    r_e = _expert_rows(r_ptr, expert.to(tl.int64), stride_se, stride_sn, KIND)
    dtype = x_ptr.dtype.element_ty
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, HIDDEN, BLOCK_K):
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(a_ptrs + k, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + k, mask=row_ok[:, None] & (k + ks < HIDDEN)[None, :], other=0.0)
        if ACT == 0:
            g = _weight_tile(w_e, s_e, r_e, cols, col_ok, k, stride_wn, stride_sn, HIDDEN, KIND, GROUP, NATIVE_FP8,
                             BLOCK_K, BLOCK_N, dtype)
            gate = tl.dot(a, g, gate, input_precision=PRECISION)
        u = _weight_tile(w_e, s_e, r_e, (INTER if ACT == 0 else 0) + cols, col_ok, k, stride_wn, stride_sn, HIDDEN,
                         KIND, GROUP, NATIVE_FP8, BLOCK_K, BLOCK_N, dtype)
        up = tl.dot(a, u, up, input_precision=PRECISION)
    act = _activate(gate, up, ACT)
    tl.store(act_ptr + slots.to(tl.int64)[:, None] * stride_a + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_block(act_ptr, w_e, s_e, r_e, weights_ptr, y_ptr, sorted_ptr, num_pairs, cols, col_ok,
                stride_a, stride_wn, stride_sn, stride_y, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                KIND: tl.constexpr, GROUP: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """y[pair, cols] = weight[pair] * (act[slot] . w2[e, cols]) for the slots of this program's block."""
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + slots)
    row_ok = pairs < num_pairs
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + slots.to(tl.int64)[:, None] * stride_a + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        if INTER % BLOCK_K == 0:
            a = tl.load(a_ptrs + k, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + k, mask=row_ok[:, None] & (k + ks < INTER)[None, :], other=0.0)
        b = _weight_tile(w_e, s_e, r_e, cols, col_ok, k, stride_wn, stride_sn, INTER, KIND, GROUP, NATIVE_FP8,
                         BLOCK_K, BLOCK_N, act_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    scale = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    y = acc * scale[:, None]
    tl.store(y_ptr + pairs.to(tl.int64)[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_choices(y_ptr, ids_ptr, out_ptr, token, cols, col_ok, num_experts, stride_y, stride_o,
                 TOP_K: tl.constexpr, Y_FROM_L2: tl.constexpr, id_base=0):
    """out[token, cols] = sum over j in order of y[token * k + j, cols] in float32; choices outside [0, E) (ids
    less id_base; never grouped, so never written) left out. Y_FROM_L2: y was written by other programs of this
    launch, so its loads skip this SM's L1."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * TOP_K + j) - id_base
        held = (expert >= 0) & (expert < num_experts)
        y_ptrs = y_ptr + (token * TOP_K + j) * stride_y + cols
        if Y_FROM_L2:
            y = tl.load(y_ptrs, mask=col_ok & held, other=0.0, cache_modifier=".cg")
        else:
            y = tl.load(y_ptrs, mask=col_ok & held, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, r_ptr, weights_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                 stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                 ids_ptr, out_ptr, arrivals_ptr, num_experts, stride_o,
                 HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                 NATIVE_FP8: tl.constexpr, TOP_K: tl.constexpr, SUM: tl.constexpr, PDL: tl.constexpr):
    """Program (block, column tile): y[pair, n] = weight[pair] * (act[slot] . w2[e, n]), stored per pair.

    SUM: the last program of a column tile to finish also sums the choices of every token over that tile into
    out (step 4 without its launch). Every program, blocks past the real groups too, counts itself in
    arrivals[column tile] after its stores (arrivals.last_to_arrive); the last one sees every y row of the tile
    and puts the count back to 0 for the next launch. The order of the sum is fixed, as in the separate kernel.
    """
    enter(PDL)
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HIDDEN
    if expert >= 0:
        e = expert.to(tl.int64)
        _down_block(act_ptr, w_ptr + e * stride_we, s_ptr + e * stride_se,
                    _expert_rows(r_ptr, e, stride_se, stride_sn, KIND), weights_ptr, y_ptr, sorted_ptr, num_pairs,
                    cols, col_ok, stride_a, stride_wn, stride_sn, stride_y, HIDDEN, INTER, BLOCK_M, BLOCK_N, BLOCK_K,
                    PRECISION, KIND, GROUP, NATIVE_FP8)
    if SUM:
        if last_to_arrive(arrivals_ptr, tl.program_id(1), tl.num_programs(0)):
            for token in range(num_pairs // TOP_K):
                _sum_choices(y_ptr, ids_ptr, out_ptr, token, cols, col_ok, num_experts, stride_y, stride_o, TOP_K,
                             True)
            leave(arrivals_ptr, tl.program_id(1))


@triton.jit
def _sum_choices_kernel(y_ptr, ids_ptr, out_ptr, num_experts, stride_y, stride_o, id_base,
                        HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (token, column block): out[t] = the sum of its choices (_sum_choices)."""
    enter(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _sum_choices(y_ptr, ids_ptr, out_ptr, tl.program_id(0).to(tl.int64), cols, cols < HIDDEN, num_experts, stride_y,
                 stride_o, TOP_K, False, id_base)


# ---------------------------------------------------------------------------------------------------------------
# One token: matrix-vector products


@triton.jit
def _one_token_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, id_base, num_experts, stride_we, stride_wn,
                         HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr, ACT: tl.constexpr = 0):
    """Program (choice j, feature tile): act[j, n] = silu(w13[e, n] . x) * (w13[e, I + n] . x) for its BLOCK_N
    features (non-gated, ACT 1 and 2: act(w1[e, n] . x)), e = ids[j] - id_base, rounded to x's dtype as the grouped
    GEMM rounds it; nothing for a choice outside [0, E) (another rank's expert). The expert comes from the kernel
    just before: no load before the wait."""
    enter(PDL)
    choice = tl.program_id(0)
    expert = tl.load(ids_ptr + choice) - id_base
    if (expert < 0) | (expert >= num_experts):
        return
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feat_ok = feats < INTER
    cols = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert.to(tl.int64) * stride_we + feats.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + (INTER if ACT == 0 else 0) * stride_wn
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, HIDDEN, BLOCK_K):
        x = _x_tile(x_ptr, k, cols, HIDDEN, BLOCK_K).to(tl.float32)[None, :]
        if ACT == 0:
            gate += _row_tile(gate_rows, k, cols, feat_ok, HIDDEN, BLOCK_K).to(tl.float32) * x
        up += _row_tile(up_rows, k, cols, feat_ok, HIDDEN, BLOCK_K).to(tl.float32) * x
    act = _activate(tl.sum(gate, axis=1), tl.sum(up, axis=1), ACT)
    tl.store(act_ptr + choice * INTER + feats, act.to(act_ptr.dtype.element_ty), mask=feat_ok)


@triton.jit
def _one_token_down_kernel(act_ptr, w_ptr, weights_ptr, ids_ptr, y_ptr, out_ptr, arrivals_ptr, id_base,
                           num_experts, stride_we, stride_wn, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                           TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRELOAD: tl.constexpr, SUM: tl.constexpr, PDL: tl.constexpr):
    """Program (column tile, choice j): y[j, n] = weight[j] * (w2[e, n] . act[j]) for its BLOCK_N columns, rounded
    to x's dtype; the last of the tile's TOP_K programs to arrive sums y over the choices in order into out (the
    rounding and order of the grouped GEMM's sum). A choice outside [0, E) stores nothing and is left out of the
    sum (SUM; without it a kernel of its own sums). The expert ids were written two launches back and no kernel
    writes weights, so the first PRELOAD tiles of the weight rows load before the wait (pdl.py), masked to nothing
    for another rank's expert."""
    tile = tl.program_id(0)
    choice = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + choice) - id_base
    held = (expert >= 0) & (expert < num_experts)
    row_ok = (rows < HIDDEN) & held
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.where(held, expert, 0).to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    preloaded = load_first_tiles(w_rows, cols, row_ok, INTER, BLOCK_K, PRELOAD)
    enter(PDL)
    y = row_dots(preloaded, w_rows, act_ptr + choice * INTER, cols, row_ok, INTER, BLOCK_N, BLOCK_K, PRELOAD)
    y = y * tl.load(weights_ptr + choice).to(tl.float32)
    tl.store(y_ptr + choice * HIDDEN + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)
    if SUM:
        if last_to_arrive(arrivals_ptr, tile, TOP_K):
            _sum_choices(y_ptr, ids_ptr, out_ptr, 0, rows, rows < HIDDEN, num_experts, HIDDEN, HIDDEN, TOP_K, True,
                         id_base)
            leave(arrivals_ptr, tile)


@triton.jit
def _packed_tile(w_rows, s_rows, k, sub, cols, row_ok, K: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                 TILE_GROUPS: tl.constexpr, SUB: tl.constexpr):
    """(bytes, scales) of the packed rows' columns k..k + TILE_GROUPS * SUB, each sub-tile of SUB columns inside
    one scale group (SUB divides GROUP): FP8 bytes [BLOCK_N, TILE_GROUPS, SUB] (KIND 1) or 4-bit codes two a byte
    [BLOCK_N, TILE_GROUPS, SUB / 2] (KIND 2 and 3, column 2j in byte j's low nibble), and the scales (4-bit: scale
    words) [BLOCK_N, TILE_GROUPS]; zero outside the rows and columns."""
    BLOCK_K: tl.constexpr = TILE_GROUPS * SUB
    group = (k + sub * SUB) // GROUP
    s = tl.load(s_rows + group[None, :], mask=row_ok[:, None] & (group < K // GROUP)[None, :], other=0)
    if KIND == 1:
        mask = row_ok[:, None, None] if K % BLOCK_K == 0 else row_ok[:, None, None] & (k + cols < K)[None]
        bits = tl.load(w_rows + k + cols[None], mask=mask, other=0, eviction_policy="evict_first")
    else:
        pairs = sub[:, None] * (SUB // 2) + tl.arange(0, SUB // 2)[None, :]
        mask = row_ok[:, None, None] if K % BLOCK_K == 0 else row_ok[:, None, None] & (k // 2 + pairs < K // 2)[None]
        bits = tl.load(w_rows + k // 2 + pairs[None], mask=mask, other=0, eviction_policy="evict_first")
    return bits, s


@triton.jit
def _packed_products(acc, bits, s, x, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                     TILE_GROUPS: tl.constexpr, SUB: tl.constexpr, row_scale=1.0):
    """acc [BLOCK_N, TILE_GROUPS, SUB] plus x [TILE_GROUPS, SUB] (float32) times the tile's weights, dequantized
    from _packed_tile's bytes and scales in float32 (fp4: times the rows' row_scale [BLOCK_N])."""
    if KIND == 1:
        if NATIVE_FP8:
            v = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, :, None]
        else:
            v = _e4m3_bits_to_float(bits) * (s * 256.0)[:, :, None]  # decoded to value / 256
    else:
        b = bits.to(tl.int32)
        q = tl.join(nibble_values(b & 15, KIND == 3), nibble_values(b >> 4, KIND == 3)).reshape(
            BLOCK_N, TILE_GROUPS, SUB)
        scale, zero = four_bit_scale_and_zero(s, KIND == 3, _rows_column(row_scale, KIND == 3))
        v = (q - zero[:, :, None]) * scale[:, :, None]
    return acc + v * x[None]


@triton.jit
def _packed_row_products(acc, w_rows, s_rows, k, x, sub, cols, row_ok, K: tl.constexpr, KIND: tl.constexpr,
                         GROUP: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                         TILE_GROUPS: tl.constexpr, SUB: tl.constexpr, row_scale=1.0):
    """acc plus x times the packed rows' weights at columns k.. (_packed_tile, then _packed_products)."""
    bits, s = _packed_tile(w_rows, s_rows, k, sub, cols, row_ok, K, KIND, GROUP, TILE_GROUPS, SUB)
    return _packed_products(acc, bits, s, x, KIND, NATIVE_FP8, BLOCK_N, TILE_GROUPS, SUB, row_scale)


@triton.jit
def _packed_x_tile(x_ptr, k, cols, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[TILE_GROUPS, SUB] float32: x's columns k + cols (0 past K)."""
    if K % BLOCK_K == 0:
        return tl.load(x_ptr + k + cols).to(tl.float32)
    return tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)


@triton.jit
def _one_token_packed_up_kernel(x_ptr, w_ptr, s_ptr, r_ptr, act_ptr, ids_ptr, num_experts, stride_we, stride_wn,
                                stride_se, stride_sn, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                                BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr, SUB: tl.constexpr,
                                KIND: tl.constexpr, GROUP: tl.constexpr, NATIVE_FP8: tl.constexpr, PDL: tl.constexpr,
                                ACT: tl.constexpr = 0, w2_ptr=None, stride_w2e=0, stride_w2n=0,
                                W2_ROW_BYTES: tl.constexpr = 0, PREFETCH_ROWS: tl.constexpr = 0,
                                W2_ROWS: tl.constexpr = 0):
    """_one_token_up_kernel on packed experts: program (choice j, feature tile), act[j, n] = silu(gate) * up of
    expert ids[j]'s packed gate and up rows (their own scales), dequantized in registers (non-gated, ACT 1 and 2:
    act(up) of its up rows, w13 [E, I, H]); nothing for a choice outside [0, E). PREFETCH_ROWS: each program then
    asks L2 for its share, PREFETCH_ROWS rows of W2_ROWS, of expert ids[j]'s w2 codes (l2_prefetch.py)."""
    enter(PDL)
    BLOCK_K: tl.constexpr = TILE_GROUPS * SUB
    choice = tl.program_id(0)
    expert = tl.load(ids_ptr + choice)
    if (expert < 0) | (expert >= num_experts):
        return
    if PREFETCH_ROWS > 0:
        prefetch_rows(w2_ptr, stride_w2e, stride_w2n, expert, tl.program_id(1), PREFETCH_ROWS, W2_ROW_BYTES, W2_ROWS)
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feat_ok = feats < INTER
    sub = tl.arange(0, TILE_GROUPS)
    cols = sub[:, None] * SUB + tl.arange(0, SUB)[None, :]
    gate_w = w_ptr + expert.to(tl.int64) * stride_we + feats.to(tl.int64)[:, None, None] * stride_wn
    gate_s = s_ptr + expert.to(tl.int64) * stride_se + feats.to(tl.int64)[:, None] * stride_sn
    up_rows = INTER if ACT == 0 else 0
    up_w, up_s = gate_w + up_rows * stride_wn, gate_s + up_rows * stride_sn
    gate_r = _expert_rows(r_ptr, expert.to(tl.int64), stride_se, stride_sn, KIND)
    gate_scale = four_bit_row_scales(gate_r, feats, feat_ok, KIND == 3)
    up_scale = four_bit_row_scales(gate_r, up_rows + feats, feat_ok, KIND == 3)
    gate = tl.zeros((BLOCK_N, TILE_GROUPS, SUB), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, TILE_GROUPS, SUB), dtype=tl.float32)
    for k in range(0, HIDDEN, BLOCK_K):
        x = _packed_x_tile(x_ptr, k, cols, HIDDEN, BLOCK_K)
        if ACT == 0:
            gate = _packed_row_products(gate, gate_w, gate_s, k, x, sub, cols, feat_ok, HIDDEN, KIND, GROUP,
                                        NATIVE_FP8, BLOCK_N, TILE_GROUPS, SUB, gate_scale)
        up = _packed_row_products(up, up_w, up_s, k, x, sub, cols, feat_ok, HIDDEN, KIND, GROUP, NATIVE_FP8,
                                  BLOCK_N, TILE_GROUPS, SUB, up_scale)
    act = _activate(tl.sum(tl.sum(gate, axis=2), axis=1), tl.sum(tl.sum(up, axis=2), axis=1), ACT)
    tl.store(act_ptr + choice * INTER + feats, act.to(act_ptr.dtype.element_ty), mask=feat_ok)


@triton.jit
def _one_token_packed_down_kernel(act_ptr, w_ptr, s_ptr, r_ptr, weights_ptr, ids_ptr, y_ptr, out_ptr, arrivals_ptr,
                                  num_experts, stride_we, stride_wn, stride_se, stride_sn, HIDDEN: tl.constexpr,
                                  INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                                  TILE_GROUPS: tl.constexpr, SUB: tl.constexpr, KIND: tl.constexpr,
                                  GROUP: tl.constexpr, NATIVE_FP8: tl.constexpr, PRELOAD: tl.constexpr,
                                  SUM: tl.constexpr, PDL: tl.constexpr):
    """_one_token_down_kernel on packed experts: program (column tile, choice j), y[j, n] = weight[j] * (w2[e, n] .
    act[j]) rounded to x's dtype; with SUM the last of the tile's TOP_K programs to arrive sums the choices in
    order (without it a kernel of its own sums them). The expert ids were written two launches back and no kernel
    writes weights, so the first PRELOAD tiles of the rows (bytes and scales) load before the wait (pdl.py), as the
    dense kernel's."""
    BLOCK_K: tl.constexpr = TILE_GROUPS * SUB
    tile = tl.program_id(0)
    choice = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + choice)
    held = (expert >= 0) & (expert < num_experts)
    row_ok = (rows < HIDDEN) & held
    sub = tl.arange(0, TILE_GROUPS)
    cols = sub[:, None] * SUB + tl.arange(0, SUB)[None, :]
    e = tl.where(held, expert, 0).to(tl.int64)
    w_rows = w_ptr + e * stride_we + rows.to(tl.int64)[:, None, None] * stride_wn
    s_rows = s_ptr + e * stride_se + rows.to(tl.int64)[:, None] * stride_sn
    row_scale = four_bit_row_scales(_expert_rows(r_ptr, e, stride_se, stride_sn, KIND), rows, row_ok, KIND == 3)
    preloaded = ()
    for t in tl.static_range(PRELOAD):
        preloaded = preloaded + (_packed_tile(w_rows, s_rows, t * BLOCK_K, sub, cols, row_ok, INTER, KIND, GROUP,
                                              TILE_GROUPS, SUB),)
    enter(PDL)
    acc = tl.zeros((BLOCK_N, TILE_GROUPS, SUB), dtype=tl.float32)
    act_row = act_ptr + choice * INTER
    for t in tl.static_range(PRELOAD):
        bits, s = preloaded[t]
        acc = _packed_products(acc, bits, s, _packed_x_tile(act_row, t * BLOCK_K, cols, INTER, BLOCK_K), KIND,
                               NATIVE_FP8, BLOCK_N, TILE_GROUPS, SUB, row_scale)
    for k in range(PRELOAD * BLOCK_K, INTER, BLOCK_K):
        acc = _packed_row_products(acc, w_rows, s_rows, k, _packed_x_tile(act_row, k, cols, INTER, BLOCK_K), sub,
                                   cols, row_ok, INTER, KIND, GROUP, NATIVE_FP8, BLOCK_N, TILE_GROUPS, SUB,
                                   row_scale)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(weights_ptr + choice).to(tl.float32)
    tl.store(y_ptr + choice * HIDDEN + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)
    if SUM:
        if last_to_arrive(arrivals_ptr, tile, TOP_K):
            _sum_choices(y_ptr, ids_ptr, out_ptr, 0, rows, rows < HIDDEN, num_experts, HIDDEN, HIDDEN, TOP_K, True)
            leave(arrivals_ptr, tile)


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def _check_routes(x, topk_weights, topk_ids) -> None:
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [{x.shape[0]}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")


def _check_args(x, w13, w2, topk_weights, topk_ids, activation: str = "swiglu") -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: use one of {', '.join(ACTIVATIONS)}")
    num_experts, rows, hidden = w13.shape
    inter = rows // 2 if activation == "swiglu" else rows
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}] for w13 {tuple(w13.shape)}, got {tuple(x.shape)}")
    if (activation == "swiglu" and rows % 2) or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {inter}] for {activation} experts w13 "
                         f"{tuple(w13.shape)}, got {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must share one dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 need unit stride in their last dim")
    _check_routes(x, topk_weights, topk_ids)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | OneTokenTiles | None = None,
              activation: str = "swiglu") -> torch.Tensor:
    """x [T, H] (bf16, fp16 or fp32); w13 [E, 2*I, H]: per expert the gate rows [0, I) then the up rows [I, 2I);
    w2 [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] int64 or int32 (values in [0, E); others add
    nothing). Returns [T, H] in x.dtype: out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) *
    (w13[e, I:] @ x[t])), e = topk_ids[t, j]. `config`: block sizes instead of the table's (pick_config), or for
    a single token the one-token path's tiles (a MoeConfig keeps it on the grouped GEMMs). `activation` "relu2" or
    "silu": non-gated experts, w13 [E, I, H] their up rows, each expert w2[e] @ act(w13[e] @ x[t])."""
    _check_args(x, w13, w2, topk_weights, topk_ids, activation)
    tokens, top_k = topk_ids.shape
    if tokens == 0 or top_k == 0:
        return x.new_zeros(x.shape)
    config = config or _table_config(tokens, top_k, w13.shape[0], x.element_size())
    ids = topk_ids.contiguous()
    if isinstance(config, OneTokenTiles):
        return _one_token_experts(x, w13, w2, topk_weights.contiguous(), ids, 0, config, activation)
    sorted_pairs, block_expert = align_pairs(ids, w13.shape[0], config.block_m)
    return _experts(x, w13, w2, topk_weights.contiguous(), ids, sorted_pairs, block_expert, config,
                    activation=activation)


def fused_moe_from_logits(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                          renormalize: bool, id_base: int = 0,
                          config: MoeConfig | OneTokenTiles | None = None) -> torch.Tensor:
    """The router's choice (moe_router.route_top_k of logits [T, E_all]) and fused_moe on it, for experts
    [id_base, id_base + E) held as w13/w2 (choices of others add nothing). A single token on the one-token path
    reads the choices with their expert numbers as they are; otherwise, up to the table's ROUTE_ALIGN_MAX_TOKENS
    the choice and the alignment are one launch."""
    tokens = x.shape[0]
    config = config or _table_config(tokens, top_k, w13.shape[0], x.element_size())
    one_token = isinstance(config, OneTokenTiles)
    if not one_token and not 0 < tokens <= ROUTE_ALIGN_MAX_TOKENS:
        weights, ids = route_top_k(logits, top_k, renormalize)
        return fused_moe(x, w13, w2, weights, ids - id_base if id_base else ids, config)
    if logits.shape[0] != tokens:
        raise ValueError(f"logits must have one row per token ({tokens}), got {tuple(logits.shape)}")
    if one_token:
        return one_token_experts(x, w13, w2, *route_top_k(logits, top_k, renormalize), id_base, config)
    weights, ids, sorted_pairs, block_expert = route_and_align(logits, top_k, renormalize, w13.shape[0],
                                                               config.block_m, id_base)
    _check_args(x, w13, w2, weights, ids)
    return _experts(x, w13, w2, weights, ids - id_base if id_base else ids, sorted_pairs, block_expert, config)


def one_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, id_base: int = 0, tiles: OneTokenTiles | None = None) -> torch.Tensor:
    """A single token's experts on a choice already made (weights [1, k] float32, ids [1, k] with every expert's
    number, this rank's being [id_base, id_base + E)): the one-token path's launches as fused_moe_from_logits runs
    them after its choice (the router's GEMV may make it: kernels/triton/router_gemv.py). `tiles`: the table's
    one-token tiles unless given; the path must be on (one_token_tiles)."""
    tiles = tiles or one_token_tiles()
    if tiles is None:
        raise ValueError(f"one_token_experts needs the one-token path, which {ONE_TOKEN_ENV} turns off")
    _check_args(x, w13, w2, topk_weights, topk_ids)
    return _one_token_experts(x, w13, w2, topk_weights, topk_ids, id_base, tiles)


def _table_config(tokens: int, top_k: int, num_experts: int, element_size: int,
                  single_token_tiles=one_token_tiles) -> MoeConfig | OneTokenTiles:
    """A single token's one-token tiles where that path is on (single_token_tiles(): the 16-bit experts' or the
    packed experts'), else the table's config."""
    if tokens == 1 and (tiles := single_token_tiles()) is not None:
        return tiles
    return pick_config(tokens, top_k, num_experts, element_size)


def fused_moe_packed(x: torch.Tensor, experts: PackedExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     config: MoeConfig | None = None) -> torch.Tensor:
    """fused_moe with packed experts (kernels/packed_experts.py): each weight tile is dequantized in registers
    (float32, rounded once to x's dtype) before its product. x [T, H] in bf16, fp16 or fp32. The table's block_k is
    narrowed so that a tile stays inside one scale group, or spans whole ones (_packed_block_k)."""
    _check_packed(x, experts, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    if tokens == 0 or top_k == 0:
        return x.new_zeros(x.shape)
    config = config or _table_config(tokens, top_k, experts.num_experts, x.element_size(), one_token_packed_tiles)
    if isinstance(config, OneTokenTiles):
        return _one_token_packed_experts(x, experts, topk_weights.contiguous(), topk_ids.contiguous(), config)
    ids = topk_ids.contiguous()
    sorted_pairs, block_expert = align_pairs(ids, experts.num_experts, config.block_m)
    return _experts(x, experts.w13, experts.w2, topk_weights.contiguous(), ids, sorted_pairs, block_expert, config,
                    experts, experts.activation)


def _check_packed(x, experts: PackedExperts, topk_weights, topk_ids) -> None:
    e, h, i = experts.num_experts, experts.hidden, experts.inter
    per_byte = 2 if experts.kind in FOUR_BIT_KINDS else 1
    if x.dim() != 2 or x.shape[1] != h:
        raise ValueError(f"x must be [T, {h}] for experts of hidden size {h}, got {tuple(x.shape)}")
    scale_type = scale_dtype(experts.kind)
    if experts.activation not in ACTIVATIONS:
        raise ValueError(f"activation {experts.activation!r}: use one of {', '.join(ACTIVATIONS)}")
    up_rows = 2 * i if experts.gated else i
    for name, w, scale, group, n, k in (("w13", experts.w13, experts.scale13, experts.group13, up_rows, h),
                                        ("w2", experts.w2, experts.scale2, experts.group2, h, i)):
        if tuple(w.shape) != (e, n, k // per_byte) or k % group or not w.is_contiguous():
            raise ValueError(f"packed {name} must be contiguous [{e}, {n}, {k // per_byte}] in groups dividing {k}, "
                             f"got {tuple(w.shape)} in groups of {group}")
        if scale.dtype != scale_type or tuple(scale.shape) != (e, n, k // group) or not scale.is_contiguous():
            raise ValueError(f"{name}'s scales must be contiguous {scale_type} [{e}, {n}, {k // group}], got "
                             f"{scale.dtype} {tuple(scale.shape)}")
    _check_routes(x, topk_weights, topk_ids)


def _packed_args(w: torch.Tensor, scale, group: int, kind: str, row_scale: torch.Tensor | None = None) -> tuple:
    """(weight as the kernel reads it, scales (int4: scale-and-zero words), row scales (fp4's [E, N], contiguous as
    the scales are: the kernels step an expert's rows by the scales' strides; the scales themselves where there are
    none, never read), scale strides (expert, row), group, KIND)."""
    if kind == "fp8":
        return w.view(torch.uint8), scale, scale, scale.stride(0), scale.stride(1), group, FP8
    if kind == "fp4" and (row_scale is None or not row_scale.is_contiguous()
                          or tuple(row_scale.shape) != tuple(scale.shape[:2]) or not scale.is_contiguous()):
        raise ValueError(f"fp4 experts need contiguous row scales [{scale.shape[0]}, {scale.shape[1]}] beside "
                         "contiguous scales")
    rows = row_scale_pointer(row_scale, scale)
    return w, scale, rows, scale.stride(0), scale.stride(1), group, FP4 if kind == "fp4" else INT4


def _experts(x, w13, w2, weights, ids, sorted_pairs, block_expert, config: MoeConfig,
             packed: PackedExperts | None = None, activation: str = "swiglu") -> torch.Tensor:
    """Steps 2 to 4 on aligned pairs (ids: this rank's expert numbers, for the sum)."""
    tokens, top_k = ids.shape
    if packed is None:
        num_experts, hidden, inter = w2.shape
        up_args = (w13, w13, w13, 0, 0, 1, DENSE)
        down_args = (w2, w2, w2, 0, 0, 1, DENSE)
    else:
        num_experts, hidden, inter = packed.num_experts, packed.hidden, packed.inter
        up_args = _packed_args(w13, packed.scale13, packed.group13, packed.kind, packed.row13)
        down_args = _packed_args(w2, packed.scale2, packed.group2, packed.kind, packed.row2)
    blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # 16-bit inputs ignore it
    native_fp8 = _native_fp8(x.device)
    launch = pdl.launch(x.device)

    act = torch.empty(blocks * config.block_m, inter, dtype=x.dtype, device=x.device)
    up = config.up
    w, s, r, stride_se, stride_sn, group, kind = up_args
    _up_swiglu_kernel[(blocks, triton.cdiv(inter, up.block_n))](
        x, w, s, r, act, sorted_pairs, block_expert, tokens * top_k, top_k,
        x.stride(0), w.stride(0), w.stride(1), stride_se, stride_sn, act.stride(0),
        HIDDEN=hidden, INTER=inter, BLOCK_M=config.block_m, BLOCK_N=up.block_n,
        BLOCK_K=up.block_k if kind == DENSE else _packed_block_k(up.block_k, group, hidden, kind),
        PRECISION=precision, KIND=kind, GROUP=group, NATIVE_FP8=native_fp8, ACT=ACTIVATIONS[activation],
        num_warps=up.num_warps, num_stages=up.num_stages, **launch)

    y = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    down = config.down
    tiles = triton.cdiv(hidden, down.block_n)
    arrivals = arrival_counts(x.device, tiles) if tokens <= SUM_IN_DOWN_MAX_TOKENS else None
    w, s, r, stride_se, stride_sn, group, kind = down_args
    _down_kernel[(blocks, tiles)](
        act, w, s, r, weights, y, sorted_pairs, block_expert, tokens * top_k,
        act.stride(0), w.stride(0), w.stride(1), stride_se, stride_sn, y.stride(0),
        ids, out, block_expert if arrivals is None else arrivals, num_experts, out.stride(0),
        HIDDEN=hidden, INTER=inter, BLOCK_M=config.block_m, BLOCK_N=down.block_n,
        BLOCK_K=down.block_k if kind == DENSE else _packed_block_k(down.block_k, group, inter, kind),
        PRECISION=precision, KIND=kind, GROUP=group, NATIVE_FP8=native_fp8, TOP_K=top_k, SUM=arrivals is not None,
        num_warps=down.num_warps, num_stages=down.num_stages, **launch)
    if arrivals is not None:
        return out

    return _sum_separately(y, ids, out, num_experts, 0, launch)


# 4-bit tiles of 16 columns (8 bytes a row) gave wrong products on an H200 (Triton 3, torch 2.11; relative errors
# near 2.8 for int4 and fp4 in groups of 16, where tiles of 32 columns and more were right): a 4-bit tile spans at
# least this many columns, whole scale groups each with its own scale.
FOUR_BIT_MIN_BLOCK_K = 32


def _packed_block_k(block_k: int, group: int, k: int, kind: int) -> int:
    """A packed tile's depth: inside one scale group (quant_pack.fit_block_k), or for 4-bit weights whose groups
    are narrower than FOUR_BIT_MIN_BLOCK_K (and divide it), that many columns over several groups."""
    fitted = fit_block_k(block_k, group, k)
    if kind in (INT4, FP4) and fitted < FOUR_BIT_MIN_BLOCK_K and group < k and FOUR_BIT_MIN_BLOCK_K % group == 0:
        return FOUR_BIT_MIN_BLOCK_K
    return fitted


def _sum_separately(y, ids, out, num_experts: int, id_base: int, launch: dict) -> torch.Tensor:
    """Step 4 in a launch of its own."""
    tokens, top_k = ids.shape
    hidden = out.shape[1]
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_choices_kernel[(tokens, triton.cdiv(hidden, block))](
        y, ids, out, num_experts, y.stride(0), out.stride(0), id_base, HIDDEN=hidden, TOP_K=top_k, BLOCK=block,
        num_warps=4, **launch)
    return out


# The one-token w2 product loads up to this many tiles of its weight rows before waiting for the w13 product.
ONE_TOKEN_PRELOAD_TILES = 4


def _one_token_experts(x, w13, w2, weights, ids, id_base: int, tiles: OneTokenTiles,
                       activation: str = "swiglu") -> torch.Tensor:
    """The experts of a single token x [1, H] as matrix-vector products (the module docstring's one-token path);
    ids [1, k] are all experts' numbers, this rank's being [id_base, id_base + E)."""
    if x.shape[0] != 1:
        raise ValueError(f"the one-token path takes a single token, got {x.shape[0]}")
    num_experts, hidden, inter = w2.shape
    top_k = ids.shape[1]
    launch = pdl.launch(x.device)
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    up = tiles.up
    _one_token_up_kernel[(top_k, triton.cdiv(inter, up.block_n))](
        x, w13, act, ids, id_base, num_experts, w13.stride(0), w13.stride(1), HIDDEN=hidden, INTER=inter,
        BLOCK_N=up.block_n, BLOCK_K=up.block_k, ACT=ACTIVATIONS[activation], num_warps=up.num_warps,
        num_stages=up.num_stages, **launch)
    down = tiles.down
    col_tiles = triton.cdiv(hidden, down.block_n)
    arrivals = arrival_counts(x.device, col_tiles)
    y = torch.empty(top_k, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _one_token_down_kernel[(col_tiles, top_k)](
        act, w2, weights, ids, y, out, ids if arrivals is None else arrivals, id_base, num_experts, w2.stride(0),
        w2.stride(1), HIDDEN=hidden, INTER=inter, TOP_K=top_k, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        PRELOAD=min(triton.cdiv(inter, down.block_k), ONE_TOKEN_PRELOAD_TILES), SUM=arrivals is not None,
        num_warps=down.num_warps, num_stages=down.num_stages, **launch)
    if arrivals is not None:
        return out
    return _sum_separately(y, ids, out, num_experts, id_base, launch)


def _tile_groups(tile, group: int, k: int) -> tuple[int, int]:
    """(TILE_GROUPS, SUB) of a one-token packed tile of tile.block_k columns over k, each sub-tile inside one scale
    group: SUB the largest power of two dividing the group, at most block_k."""
    block_k = min(tile.block_k, triton.next_power_of_2(k))
    sub = min(block_k, group & -group)
    return block_k // sub, sub


def _down_prefetch(w2: torch.Tensor, programs: int, launch: dict) -> dict:
    """The w13 launch's arguments that have its programs ask L2 for their experts' w2 codes, a run of whole rows
    each of `programs` programs an expert (with dependent launch, unless SHARDSERVE_MOE_PREFETCH_DOWN=off; FP8
    only: l2_prefetch.py), else none."""
    if not (launch["PDL"] and envs.MOE_PREFETCH_DOWN.get() == "on"):
        return {}
    return rows_prefetch(w2, programs)


def _one_token_packed_experts(x, experts: PackedExperts, weights, ids, tiles: OneTokenTiles) -> torch.Tensor:
    """A single token's packed experts as matrix-vector products (the one-token path, each weight tile
    dequantized in registers; layers/moe_packed.packed_fused takes moe_four_bit's float16 pair sums before this
    where they fit): two launches, the w2 product's last programs summing the choices."""
    if x.shape[0] != 1:
        raise ValueError(f"the one-token path takes a single token, got {x.shape[0]}")
    num_experts, hidden, inter = experts.num_experts, experts.hidden, experts.inter
    top_k = ids.shape[1]
    native, launch = _native_fp8(x.device), pdl.launch(x.device)
    w13, s13, r13, se13, sn13, g13, kind = _packed_args(experts.w13, experts.scale13, experts.group13, experts.kind,
                                                        experts.row13)
    w2, s2, r2, se2, sn2, g2, _ = _packed_args(experts.w2, experts.scale2, experts.group2, experts.kind, experts.row2)
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    up = tiles.up
    groups, sub = _tile_groups(up, g13, hidden)
    feature_tiles = triton.cdiv(inter, up.block_n)
    _one_token_packed_up_kernel[(top_k, feature_tiles)](
        x, w13, s13, r13, act, ids, num_experts, w13.stride(0), w13.stride(1), se13, sn13, HIDDEN=hidden, INTER=inter,
        BLOCK_N=up.block_n, TILE_GROUPS=groups, SUB=sub, KIND=kind, GROUP=g13, NATIVE_FP8=native,
        ACT=ACTIVATIONS[experts.activation], num_warps=up.num_warps, num_stages=up.num_stages,
        **(_down_prefetch(w2, feature_tiles, launch) if kind == FP8 else {}), **launch)
    down = tiles.down
    col_tiles = triton.cdiv(hidden, down.block_n)
    groups, sub = _tile_groups(down, g2, inter)
    y = torch.empty(top_k, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    arrivals = arrival_counts(x.device, col_tiles)
    _one_token_packed_down_kernel[(col_tiles, top_k)](
        act, w2, s2, r2, weights, ids, y, out, ids if arrivals is None else arrivals, num_experts, w2.stride(0),
        w2.stride(1), se2, sn2, HIDDEN=hidden, INTER=inter, TOP_K=top_k, BLOCK_N=down.block_n, TILE_GROUPS=groups,
        SUB=sub, KIND=kind, GROUP=g2, NATIVE_FP8=native, SUM=arrivals is not None,
        PRELOAD=min(triton.cdiv(inter, groups * sub), ONE_TOKEN_PRELOAD_TILES), num_warps=down.num_warps,
        num_stages=down.num_stages, **launch)
    if arrivals is not None:
        return out
    return _sum_separately(y, ids, out, num_experts, 0, launch)
