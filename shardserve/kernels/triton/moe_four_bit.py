"""A single token's 4-bit experts (int4 or e2m1 codes, groups of 16 or more) with float16 pair sums: the one-token
path of fused_moe (program (choice, row tile) for the up product, program (column tile, choice) for the down
product whose last program of a tile sums the choices), reading each weight as the split-K GEMV's float16 sums read
it (quant_gemv._word_pair_sums: a nibble or an e2m1 code moved into a float16 half, two weights in one paired
multiply-add) instead of dequantizing every weight to float32 with its scale (fused_moe._packed_products). The
group scales multiply the sums of each sub-tile of SUB columns; x enters each chunk of CHUNK columns scaled by
its own power of two (quant_gemv._split_pairs). Tiles: [sub-tile, row, word], so a program's x pairs serve all
its rows.

Float16 sums keep these kernels to 16-bit activations: a float32 model takes fused_moe's kernels (their start-up
check against float64 holds float32 to a tighter bound).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shardserve import envs
from shardserve.kernels.fused_moe_table import OneTokenTiles, Tile, parse_one_token_tiles
from shardserve.kernels.packed_experts import PackedExperts
from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.arrivals import arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.fused_moe import ACTIVATIONS, _activate, _sum_separately, _tile_groups
from shardserve.kernels.triton.pdl import enter
from shardserve.kernels.triton.quant_gemv import (_split_pairs, _word_pair_sums, apply_group_scales, fp4_row_factor,
                                                  group_scale_words, row_scale_pointer)

# (block_n, CHUNK columns, num_warps, num_stages) of the up and the down product: the fastest of a grid (block_n
# 8-64, chunks of 256-1024, 4 or 8 warps) on an H200 at Nemotron-3-Nano's NVFP4 experts (e4m3 scale bytes) with its
# shared expert as two slots (8 choices), each chunk's words and scales loaded while the one before is summed: 29.5 us
# a layer (benchmarks/moe_four_bit_one_token.py --sweep --shared-slots 2); without that prefetch the best was
# (64, 512, 8, 1) + (64, 512, 4, 1) at 30.1 us, and the decode step's graph replay 1.693 ms against 1.663 with it
# (docs/benchmarks-notebook.md).
FOUR_BIT_PAIR_TILES = OneTokenTiles(Tile(32, 512, 4, 1), Tile(64, 256, 4, 1))


def four_bit_pair_tiles() -> OneTokenTiles:
    """FOUR_BIT_PAIR_TILES, or the tiles SHARDSERVE_MOE_FOUR_BIT_TILES says ("up/down", to tune on another GPU)."""
    value = envs.MOE_FOUR_BIT_TILES.get()
    return FOUR_BIT_PAIR_TILES if value is None else parse_one_token_tiles(value, envs.MOE_FOUR_BIT_TILES.name)


@triton.jit
def _chunk_of_words(row_words, row_ok, k, word, K: tl.constexpr):
    """The [sub-tile, row, word] words of the rows from column k on (row_words: each row's first word); 0 past K."""
    at = k // 8 + word[:, None, :]
    return tl.load(row_words + at, mask=row_ok[None, :, None] & (at < K // 8), other=0, eviction_policy="evict_first")


@triton.jit
def _rows_sums(x_ptr, w_rows, s_rows, r_rows, rows, row_ok, stretch, K: tl.constexpr, GROUP: tl.constexpr,
               CHUNK: tl.constexpr, SUB: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr):
    """[sub-tile, row]: the scaled sums of x [K] times the rows' 4-bit weights (w_rows: int32 words, 8 columns
    each; s_rows: scales; r_rows: fp4's row scales, row r's at r), chunk by chunk, columns past K masked. Row r
    starts stretch * r * K / 8 words (and stretch * r * K / GROUP scales) on: 1 for whole rows, m for a K-column
    slice of rows m times longer. A chunk's words and scales are loaded while the chunk before is summed: a
    program's rows stream their columns in several chunks, and one chunk in flight a program leaves too few bytes
    in flight.
    """
    SUBS: tl.constexpr = CHUNK // SUB
    WORDS: tl.constexpr = SUB // 8
    sub = tl.arange(0, SUBS)
    word = sub[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    row_factor = fp4_row_factor(r_rows, rows, row_ok, FP4)
    rows = rows * stretch
    row_words = w_rows + rows.to(tl.int64)[None, :, None] * (K // 8)
    acc = tl.zeros((SUBS, rows.shape[0]), dtype=tl.float32)
    w_next = _chunk_of_words(row_words, row_ok, 0, word, K)
    s_next = group_scale_words(s_rows, rows, row_ok, 0, sub, K, GROUP, SUB)
    for k in range(0, K, CHUNK):
        # the next chunk's words and scales are loaded before this one is summed (none past K: all masked)
        w, s_words = w_next, s_next
        w_next = _chunk_of_words(row_words, row_ok, k + CHUNK, word, K)
        s_next = group_scale_words(s_rows, rows, row_ok, k + CHUNK, sub, K, GROUP, SUB)
        x_sum, x04, x15, x26, x37, unscale = _split_pairs(x_ptr, x_ptr, x_ptr, k + word * 8, 0.0, False, False, FP4,
                                                          K)
        sums = _word_pair_sums(w, x04, x15, x26, x37, SUBS, w.shape[1], WORDS, ASM, FP4)
        acc += apply_group_scales(tl.sum(sums, axis=2) * unscale, x_sum, s_words, FP4)
    if FP4:
        acc *= row_factor[None, :]
    return acc


@triton.jit
def _up_kernel(x_ptr, w_ptr, s_ptr, r_ptr, act_ptr, ids_ptr, num_experts, shared_w_ptr, shared_s_ptr, shared_r_ptr,
               HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr,
               ACT: tl.constexpr, PDL: tl.constexpr):
    """Program (choice j, feature tile): act[j, n] = silu(gate) * up of expert ids[j]'s rows n and I + n (non-gated,
    ACT 1 and 2: act(up) of its row n), rounded to x's dtype; nothing for a choice outside [0, E). Choices j >= TOP_K
    (non-gated only) are the shared expert's slots: rows (j - TOP_K) * I + n of its up projection."""
    enter(PDL)
    choice = tl.program_id(0)
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feat_ok = feats < INTER
    rows_per_expert: tl.constexpr = 2 * INTER if ACT == 0 else INTER
    if choice < TOP_K:
        expert = tl.load(ids_ptr + choice)
        if (expert < 0) | (expert >= num_experts):
            return
        w_e = w_ptr + expert.to(tl.int64) * (rows_per_expert * (HIDDEN // 8))
        s_e = s_ptr + expert.to(tl.int64) * (rows_per_expert * (HIDDEN // GROUP))
        r_e = r_ptr + expert.to(tl.int64) * rows_per_expert
    else:
        w_e = shared_w_ptr + (choice - TOP_K).to(tl.int64) * (INTER * (HIDDEN // 8))
        s_e = shared_s_ptr + (choice - TOP_K).to(tl.int64) * (INTER * (HIDDEN // GROUP))
        r_e = shared_r_ptr + (choice - TOP_K).to(tl.int64) * INTER
    up_rows = feats + (INTER if ACT == 0 else 0)
    up = tl.sum(_rows_sums(x_ptr, w_e, s_e, r_e, up_rows, feat_ok, 1, HIDDEN, GROUP, CHUNK, SUB, FP4, ASM), axis=0)
    gate = up
    if ACT == 0:
        gate = tl.sum(_rows_sums(x_ptr, w_e, s_e, r_e, feats, feat_ok, 1, HIDDEN, GROUP, CHUNK, SUB, FP4, ASM),
                      axis=0)
    act = _activate(gate, up, ACT)
    tl.store(act_ptr + choice * INTER + feats, act.to(act_ptr.dtype.element_ty), mask=feat_ok)


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, r_ptr, weights_ptr, ids_ptr, y_ptr, out_ptr, arrivals_ptr, num_experts,
                 shared_w_ptr, shared_s_ptr, shared_r_ptr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                 TOP_K: tl.constexpr, SHARED: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr, SUB: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr, SUM: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (column tile, choice j): y[j, n] = weight[j] * (w2[e, n] . act[j]) rounded to x's dtype; choices
    j >= TOP_K are the shared expert's SHARED slots, weight 1: columns (j - TOP_K) * I ... of its down projection
    [H, SHARED * I]. With SUM the last of the tile's programs to arrive sums the choices in order (the routed ones
    held here, then the slots)."""
    enter(PDL)
    tile = tl.program_id(0)
    choice = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if choice < TOP_K:
        expert = tl.load(ids_ptr + choice)
        held = (expert >= 0) & (expert < num_experts)
        e = tl.where(held, expert, 0).to(tl.int64)
        w_e = w_ptr + e * (HIDDEN * (INTER // 8))
        s_e = s_ptr + e * (HIDDEN * (INTER // GROUP))
        r_e = r_ptr + e * HIDDEN
        stretch = tl.full((), 1, tl.int32)
        weight = tl.load(weights_ptr + choice).to(tl.float32)
    else:
        held = choice >= TOP_K
        w_e = shared_w_ptr + (choice - TOP_K) * (INTER // 8)
        s_e = shared_s_ptr + (choice - TOP_K) * (INTER // GROUP)
        r_e = shared_r_ptr  # every slot is a slice of the same rows
        stretch = tl.full((), SHARED, tl.int32)
        weight = tl.full((), 1.0, tl.float32)
    row_ok = (rows < HIDDEN) & held
    sums = _rows_sums(act_ptr + choice * INTER, w_e, s_e, r_e, rows, row_ok, stretch, INTER, GROUP, CHUNK, SUB, FP4,
                      ASM)
    y = tl.sum(sums, axis=0) * weight
    tl.store(y_ptr + choice * HIDDEN + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)
    if SUM:
        if last_to_arrive(arrivals_ptr, tile, TOP_K + SHARED):
            _sum_all(y_ptr, ids_ptr, out_ptr, rows, rows < HIDDEN, num_experts, HIDDEN, TOP_K, SHARED)
            leave(arrivals_ptr, tile)


@triton.jit
def _sum_all(y_ptr, ids_ptr, out_ptr, cols, col_ok, num_experts, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
             SHARED: tl.constexpr):
    """out[cols] = the sum in float32, in order, of y's rows: the routed choices held here (fused_moe._sum_choices'
    rule), then the SHARED slots; rounded once. y was written by other programs: its loads skip this SM's L1."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K + SHARED):
        held = col_ok
        if j < TOP_K:
            expert = tl.load(ids_ptr + j)
            held = held & (expert >= 0) & (expert < num_experts)
        acc += tl.load(y_ptr + j * HIDDEN + cols, mask=held, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def takes_float16_pairs(experts: PackedExperts, dtype: torch.dtype) -> bool:
    """Whether these kernels take the experts: 4-bit codes in groups of a multiple of 16 (sub-tiles of two whole
    words), contiguous tensors, 16-bit activations, and SHARDSERVE_MOE_FOUR_BIT_SUMS not float32."""
    return (experts.kind in ("int4", "fp4") and dtype in (torch.bfloat16, torch.float16)
            and envs.MOE_FOUR_BIT_SUMS.get() == "float16"
            and all(g % 16 == 0 and k % g == 0 for g, k in ((experts.group13, experts.hidden),
                                                            (experts.group2, experts.inter)))
            and all(t.is_contiguous() for t in (experts.w13, experts.scale13, experts.w2, experts.scale2))
            and (experts.kind != "fp4" or all(t is not None and t.is_contiguous()
                                              for t in (experts.row13, experts.row2))))


def _chunk_and_sub(tile: Tile, group: int, k: int) -> tuple[int, int]:
    """(CHUNK, SUB) of a tile over K columns in groups of `group`: fused_moe._tile_groups' sub-tiles, which must
    hold two whole words (16 columns) for the float16 pairs."""
    groups, sub = _tile_groups(tile, group, k)
    if sub < 16:
        raise ValueError(f"4-bit float16 pair sums need chunks of 16 columns or more, got tile {tile}")
    return groups * sub, sub


class SharedSlots(NamedTuple):
    """A non-gated shared expert computed as `slots` more choices of weight 1 beside the routed ones: its up
    projection's rows up [slots * I, H / 2] (codes) and up_scale, its down projection down [H, slots * I / 2] and
    down_scale, packed as the experts are (kind, groups; fp4: with their row scales); slot j is features
    j * I ... (j + 1) * I."""
    up: torch.Tensor
    up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    slots: int
    up_row_scale: torch.Tensor | None = None
    down_row_scale: torch.Tensor | None = None


def shared_slots_fit(experts: PackedExperts, up: torch.Tensor, up_scale: torch.Tensor, down: torch.Tensor,
                     down_scale: torch.Tensor, up_row_scale: torch.Tensor | None = None,
                     down_row_scale: torch.Tensor | None = None) -> int:
    """How many slots of the experts' width a non-gated shared expert packed as the experts are makes (its features a
    multiple of theirs, contiguous tensors of the experts' dtypes), or 0 where it does not fit."""
    features, hidden, inter = up.shape[0], experts.hidden, experts.inter
    if experts.gated or features % inter or up.shape[1] * 2 != hidden or tuple(down.shape) != (hidden, features // 2):
        return 0
    if inter % experts.group2 or up_scale.shape != (features, hidden // experts.group13) \
            or down_scale.shape != (hidden, features // experts.group2):  # each slot's columns whole groups
        return 0
    tensors = (up, up_scale, down, down_scale)
    if any(not t.is_contiguous() for t in tensors) or (up.dtype, up_scale.dtype) != (experts.w13.dtype,
                                                                                    experts.scale13.dtype):
        return 0
    rows = ((up_row_scale, features), (down_row_scale, hidden))
    if experts.kind == "fp4" and any(t is None or tuple(t.shape) != (n,) or not t.is_contiguous() for t, n in rows):
        return 0
    return features // inter


def one_token_four_bit_experts(x: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, ids: torch.Tensor,
                               tiles: OneTokenTiles | None = None,
                               shared: SharedSlots | None = None) -> torch.Tensor:
    """out [1, H] = sum_j weights[0, j] * w2[e_j] @ act(w13[e_j] @ x[0]) for a single token x [1, H] and its choices
    ids [1, k] (every choice outside [0, E) left out), as takes_float16_pairs allows; with `shared`, plus the shared
    expert's slots, weight 1, in the same two launches. tiles: four_bit_pair_tiles() unless given."""
    if x.shape[0] != 1 or not takes_float16_pairs(experts, x.dtype):
        raise ValueError("one_token_four_bit_experts takes one 16-bit token and 4-bit experts in groups of 16 or more")
    tiles = tiles or four_bit_pair_tiles()
    num_experts, hidden, inter = experts.num_experts, experts.hidden, experts.inter
    top_k, slots = ids.shape[1], shared.slots if shared is not None else 0
    choices = top_k + slots
    fp4, asm, launch = experts.kind == "fp4", x.is_cuda, pdl.launch(x.device)
    w13, w2 = experts.w13.view(torch.int32), experts.w2.view(torch.int32)
    rows13, rows2 = row_scale_pointer(experts.row13, experts.scale13), row_scale_pointer(experts.row2, experts.scale2)
    shared_up, shared_up_scale, shared_down, shared_down_scale = (
        (shared.up.view(torch.int32), shared.up_scale, shared.down.view(torch.int32), shared.down_scale)
        if shared is not None else (w13, experts.scale13, w2, experts.scale2))
    shared_up_rows, shared_down_rows = (
        (shared.up_row_scale, shared.down_row_scale) if shared is not None and fp4 else (rows13, rows2))
    act = torch.empty(choices, inter, dtype=x.dtype, device=x.device)
    up = tiles.up
    chunk, sub = _chunk_and_sub(up, experts.group13, hidden)
    _up_kernel[(choices, triton.cdiv(inter, up.block_n))](
        x, w13, experts.scale13, rows13, act, ids, num_experts, shared_up, shared_up_scale, shared_up_rows,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, GROUP=experts.group13, BLOCK_N=up.block_n, CHUNK=chunk, SUB=sub,
        FP4=fp4, ASM=asm, ACT=ACTIVATIONS[experts.activation], num_warps=up.num_warps, num_stages=up.num_stages,
        **launch)
    down = tiles.down
    chunk, sub = _chunk_and_sub(down, experts.group2, inter)
    col_tiles = triton.cdiv(hidden, down.block_n)
    y = torch.empty(choices, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    arrivals = arrival_counts(x.device, col_tiles)
    if arrivals is None and slots:
        raise ValueError("one_token_four_bit_experts sums a shared expert's slots in its down launch only: "
                         f"{col_tiles} column tiles are more than the arrival counts")
    _down_kernel[(col_tiles, choices)](
        act, w2, experts.scale2, rows2, weights, ids, y, out, ids if arrivals is None else arrivals, num_experts,
        shared_down, shared_down_scale, shared_down_rows, HIDDEN=hidden, INTER=inter, TOP_K=top_k, SHARED=slots,
        GROUP=experts.group2, BLOCK_N=down.block_n, CHUNK=chunk, SUB=sub, FP4=fp4, ASM=asm,
        SUM=arrivals is not None, num_warps=down.num_warps, num_stages=down.num_stages, **launch)
    if arrivals is not None:
        return out
    return _sum_separately(y, ids, out, num_experts, 0, launch)
