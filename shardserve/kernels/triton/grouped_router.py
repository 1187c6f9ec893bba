"""Grouped top-k routing in one launch: NemotronH's and DeepSeek-V3's sigmoid scores with a score-correction bias,
DeepSeek-V2's softmax, with or without expert groups (layers/grouped_topk.py states the routing; its grouped_top_k
is the reference this kernel is checked against).

The torch version takes about ten launches a layer (sigmoid, bias add, the groups' top two and their top, the mask,
top-k, gather, sum, divide, scale): at batch 1 on an H200 about 0.4 ms of a 3.35 ms decode step of a DeepSeek-V3
-shaped model with 26 sparse layers (Moonlight-16B-A3B). One program per token holds the token's E logits in
registers, laid out as [groups, experts of a group] (each padded to a power of two), and writes weights [T, k]
float32 and expert ids [T, k] int64, as moe_router.route_top_k does. It reads nothing back on the host, so CUDA
graphs capture it. Replayed from a CUDA graph on an H200, one token's choice took 1.6 us instead of 13.1 at 64
experts, top 6 (the router's GEMV and the choice: 5.2 us instead of 16.6), and 2.7 us instead of 39.2 at
DeepSeek-V3's 256 experts, top 8 of 4 in 8 groups (benchmarks/grouped_router.py,
benchmarks/results/grouped-router-nvidia-h200-20261129.json).

The choice: every expert's score for the choice (sigmoid(logit) + bias; with softmax scoring and no bias the logit
itself, since softmax is monotonic) becomes an int32 ordered as the float32 (its bits made monotonic), the expert
with the larger value winning and ties going to the LOWER expert index (groups likewise: ties to the lower group);
a chosen expert is closed (below every open one) and never chosen again. With groups, a group's worth is the sum of
its two best values (sigmoid: the two largest scores, a tie counted twice as torch.topk does) or its best value
(softmax), and the topk_groups groups that fewer than topk_groups groups beat stay open. NaN scores rank above
+inf, as in torch.topk.

A round of the top k depends on how many warps hold the tile:
- one warp (up to 128 experts): three int32 maxima or minima, each one warp-reduction instruction: the largest
  value, the lowest place holding it, and the chosen expert's score (a maximum of its bits, every other place at
  INT32_MIN). On an H200, replayed from a graph of 23, one token's choice at Nemotron-3-Nano's 128 experts, top 6,
  took 1.19 us against 1.68 with the int64 keys below and a gather of the chosen logits (1.08 against 1.58 at 64
  experts), and its batch-1 NVFP4 step 1.2292 ms against 1.2351 with the same tokens
  (benchmarks/results/grouped-router-one-warp-nvidia-h200-20261202.json);
- more warps: each reduction crosses warps through shared memory, so a round is one maximum of int64 keys ordering
  (value, -place), the value's bits above the place's from the end (2.7 us at DeepSeek-V3's 256 experts over two
  warps, against 3.8 with the three int32 reductions a round). The weights are then gathered: the chosen experts'
  logits, through the scores' formula again.

The weights are the chosen experts' unbiased scores (sigmoid, or exp(l - max) / sum over all experts, the sum taken
in fixed point: moe_router's _fixed_point_sum), renormalised (divided by their sum + 1e-20) where the route says so,
then times the route's scaling factor: the same bits in either form. The ids come in choice order (best first); the
layers do not depend on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.moe_router import _fixed_point_sum, route_warps, routing_outputs
from shardserve.kernels.triton.pdl import enter, launch_next

if TYPE_CHECKING:
    from shardserve.config import GroupedTopK

# The most experts the kernel routes: the padded [groups, experts] tile lives in one program's registers (int64
# keys and float32 logits: at 512 experts over two warps, 8 of each a thread).
MAX_GROUPED_EXPERTS = 512
# Below every ordered value _ordered_bits makes: what an expert that cannot be chosen (chosen already, in a dropped
# group, past E) holds.
CLOSED = tl.constexpr(-(2 ** 31))
# Below every key _place_keys makes: the same for the int64 keys.
CLOSED_KEY = tl.constexpr(-(2 ** 63))


@triton.jit
def _ordered_bits(values):
    """int32 ordered as float32 values: the value's bits made monotonic (a negative float's magnitude bits
    flipped; -0.0 ranks as 0.0), every one above CLOSED."""
    bits = values.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(2 ** 31), 0, bits)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.maximum(ordered, CLOSED + 1)


@triton.jit
def _ordered_value(ordered):
    """The float32 value of _ordered_bits."""
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _place_keys(ordered, places, LAST: tl.constexpr):
    """int64 keys ordered as (value, -place): the value's _ordered_bits in the high 32 bits, LAST - place (>= 0) in
    the low."""
    return (ordered.to(tl.int64) << 32) | (LAST - places).to(tl.int64)


@triton.jit
def _scores(logits, top, total, SOFTMAX: tl.constexpr):
    """The experts' unbiased scores, what a chosen one weighs: sigmoid, or exp(logit - top) / total (softmax's top
    logit and its sum over all experts)."""
    if SOFTMAX:
        return tl.exp(logits - top) / total
    else:
        return 1.0 / (1.0 + tl.exp(-logits))


@triton.jit
def _tile_max(tile):
    return tl.max(tl.max(tile, axis=1), axis=0)


@triton.jit
def _tile_min(tile):
    return tl.min(tl.min(tile, axis=1), axis=0)


@triton.jit
def _grouped_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, stride_logits,
                          scaling_factor, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, NUM_GROUPS: tl.constexpr,
                          GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                          SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                          ONE_WARP: tl.constexpr, PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    """One token per program: the module docstring's choice and weights, to weights_ptr[token * k + j] and
    ids_ptr[...]. Expert e is at [e // group_size, e % group_size] of the [GROUPS_P, GROUP_P] tile, its place
    there numbered row by row (places keep the experts' order, so ties to the lower place are ties to the lower
    expert). PDL: launched to overlap the kernel before it (kernels/triton/pdl.py); NEXT_EARLY: the next launches
    at this one's start (pdl.py's early launches)."""
    if NEXT_EARLY:
        launch_next(PDL)
    token = tl.program_id(0).to(tl.int64)
    PLACES: tl.constexpr = GROUPS_P * GROUP_P
    group_of = tl.arange(0, GROUPS_P)
    groups = group_of[:, None]
    within = tl.arange(0, GROUP_P)[None, :]
    experts = groups * group_size + within
    places = groups * GROUP_P + within
    real = (groups < NUM_GROUPS) & (within < group_size)
    if HAS_BIAS:  # a weight, written by no kernel of the step: read before the wait
        bias = tl.load(bias_ptr + experts, mask=real, other=0.0).to(tl.float32)
    enter(PDL, NEXT_EARLY)
    row = logits_ptr + token * stride_logits
    logits = tl.load(row + experts, mask=real, other=float("-inf")).to(tl.float32)

    if SOFTMAX:
        top = _tile_max(logits)
        # The sum over all experts, exact in fixed point whatever the order (each exp in [0, 1], the top one 1).
        exps = tl.where(real, tl.exp(logits - top), 0.0)
        total = _fixed_point_sum(tl.reshape(exps, [PLACES], can_reorder=True))
    else:  # softmax's alone
        top = 0.0
        total = 1.0
    scores = _scores(logits, top, total, SOFTMAX)  # 0 past E (its logits -inf)
    for_choice = scores  # what chooses an expert
    if SOFTMAX and not HAS_BIAS:
        for_choice = logits  # softmax is monotonic: the logits order the experts as their scores do
    if HAS_BIAS:
        for_choice += bias
    ordered = tl.where(real, _ordered_bits(for_choice), CLOSED)

    if NUM_GROUPS > 1:
        best = tl.max(ordered, axis=1)  # [GROUPS_P]: each group's best value
        worth = _ordered_value(best)
        if not SOFTMAX:  # plus its second best: the best's lowest place closed, the next maximum
            first = tl.min(tl.where(ordered == best[:, None], within, GROUP_P), axis=1)
            worth += _ordered_value(tl.max(tl.where(within == first[:, None], CLOSED, ordered), axis=1))
        GROUPS_LAST: tl.constexpr = GROUPS_P - 1
        group_keys = tl.where(group_of < NUM_GROUPS, _place_keys(_ordered_bits(worth), group_of, GROUPS_LAST),
                              CLOSED_KEY)
        # A group stays where fewer than TOPK_GROUPS groups beat it (keys are distinct: exactly TOPK_GROUPS stay).
        beaten_by = tl.sum((group_keys[None, :] > group_keys[:, None]).to(tl.int32), axis=1)
        ordered = tl.where((beaten_by < TOPK_GROUPS)[:, None], ordered, CLOSED)

    slots = tl.arange(0, TOP_K_P)
    keep = slots < TOP_K
    chosen_places = tl.zeros([TOP_K_P], dtype=tl.int32)
    if ONE_WARP:
        # The top k, a round each: the largest value, then the lowest place holding it, then that place closed; the
        # chosen expert's score comes out the same way, as the maximum of its bits against INT32_MIN at every other
        # place (a score is never negative). Each reduction is over int32 within one warp: a single instruction.
        score_bits = scores.to(tl.int32, bitcast=True)
        weights = tl.zeros([TOP_K_P], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            value = _tile_max(ordered)
            place = _tile_min(tl.where(ordered == value, places, PLACES))
            taken = places == place
            ordered = tl.where(taken, CLOSED, ordered)
            weight = _tile_max(tl.where(taken, score_bits, -(2 ** 31))).to(tl.float32, bitcast=True)
            chosen_places = tl.where(slots == j, place, chosen_places)
            weights = tl.where(slots == j, weight, weights)
    else:
        # Across warps every reduction crosses through shared memory, so a round is one: the maximum of int64 keys
        # ordering (value, -place), the tile's keys in any order (each carries its place). The weights are gathered
        # after, from the chosen experts' logits, with the same formula as the scores'.
        LAST: tl.constexpr = PLACES - 1
        keys = tl.where(ordered == CLOSED, CLOSED_KEY, _place_keys(ordered, places, LAST))
        keys = tl.reshape(keys, [PLACES], can_reorder=True)
        for j in tl.static_range(TOP_K):
            chosen = tl.max(keys, axis=0)
            keys = tl.where(keys == chosen, CLOSED_KEY, keys)
            chosen_places = tl.where(slots == j, LAST - (chosen & 0x7FFFFFFF).to(tl.int32), chosen_places)
    ids = (chosen_places // GROUP_P) * group_size + chosen_places % GROUP_P
    ids = tl.minimum(tl.maximum(ids, 0), num_experts - 1)  # in range whatever the scores (NaN, -inf bias)
    if not ONE_WARP:
        chosen_logits = tl.load(row + ids, mask=keep, other=0.0).to(tl.float32)
        weights = tl.where(keep, _scores(chosen_logits, top, total, SOFTMAX), 0.0)

    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling_factor
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids.to(ids_ptr.dtype.element_ty), mask=keep)


def grouped_route(logits: torch.Tensor, correction_bias: torch.Tensor | None, route: GroupedTopK,
                  num_warps: int | None = None, next_early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype; float32 from GroupedTopKRouter) and the score-correction bias [E] or None ->
    (weights [T, k] float32, expert ids [T, k] int64): layers/grouped_topk.grouped_top_k's choice (the same experts
    where no two scores tie; ties to the lower expert index) with its weights up to rounding. num_warps: the
    launch's (route_warps of the padded tile unless given). next_early: as moe_router.route_top_k's."""
    tokens, num_experts = logits.shape
    if num_experts != route.num_experts:
        raise ValueError(f"logits for {num_experts} experts, the route has {route.num_experts}")
    if num_experts > MAX_GROUPED_EXPERTS:
        raise ValueError(f"the grouped router takes at most {MAX_GROUPED_EXPERTS} experts, got {num_experts}")
    logits, weights, ids = routing_outputs(logits, route.top_k)
    if correction_bias is not None:
        correction_bias = correction_bias.to(torch.float32).contiguous()
    if tokens:
        group_size = num_experts // route.num_groups
        groups_p, group_p = triton.next_power_of_2(route.num_groups), triton.next_power_of_2(group_size)
        num_warps = num_warps or route_warps(groups_p * group_p)
        _grouped_route_kernel[(tokens,)](
            logits, logits if correction_bias is None else correction_bias, weights, ids, num_experts, group_size,
            logits.stride(0), float(route.scaling_factor), TOP_K=route.top_k,
            TOP_K_P=triton.next_power_of_2(route.top_k), NUM_GROUPS=route.num_groups, GROUPS_P=groups_p,
            GROUP_P=group_p, TOPK_GROUPS=route.topk_groups, SOFTMAX=route.scoring == "softmax",
            HAS_BIAS=correction_bias is not None, RENORMALIZE=route.renormalize, num_warps=num_warps,
            ONE_WARP=num_warps == 1,
            **pdl.launch(logits.device, next_early))
    return weights, ids
