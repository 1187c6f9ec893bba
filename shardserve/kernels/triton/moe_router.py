"""A mixture-of-experts router's choice in one launch: softmax over the experts' logits, the top k, and their
weights renormalised to sum to 1 where the model says so.

The torch version (layers/moe.py SparseMoE.route) takes six to seven launches a layer (cast, softmax, top-k's
gather and sort, sum, divide); at batch 1 on 48 layers that is most of a millisecond a token, more than the
experts' own GEMMs take to read a quarter of their weights. One program per token holds its E logits in registers.

Ties pick the lower expert index. Choices are made on the logits (the softmax is monotonic), weights are
exp(l - max) / sum over all experts (or over the chosen k when renormalising), in float32. A round of the choice
is one integer maximum over keys that order (logit, -index) where the logits are 16-bit (_choice_keys: on an H100
a single token's choice and alignment took 3.1 us instead of 5.5 with a float maximum and an index minimum a
round).

The results do not depend on how a launch lays the logits out over its threads (its warps): maxima and minima are
exact in any order, the chosen k are summed one after another in choice order, and the sum over all experts is
taken in fixed point, where addition is exact. So the choice is the same bit for bit in this module's launch and
in the last program of a wider one (the router's GEMV, kernels/triton/router_gemv.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.pdl import enter, launch_next


# Exps in fixed point, as whole multiples of 2^-48: the exps of up to MAX_EXPERTS experts (each at most 1) sum
# within int64.
FIXED_POINT_ONE = tl.constexpr(2.0 ** 48)
MAX_EXPERTS = 1 << 15
# Below every key _choice_keys makes: what an expert not to be chosen (chosen already, or past E) holds.
CLOSED_KEY = tl.constexpr(-(2 ** 31))


@triton.jit
def route_token(logits_ptr, weights_ptr, ids_ptr, token, num_experts, stride_logits,
                TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, EXPERTS_P: tl.constexpr, RENORMALIZE: tl.constexpr,
                LOGITS_FROM_L2: tl.constexpr = False, SHARED: tl.constexpr = False):
    """Token `token`'s k choices: weights to weights_ptr[token * k + j], expert ids to ids_ptr[...]; returns the
    ids, [TOP_K_P] int32 (0 past k). LOGITS_FROM_L2: the logits were stored by other programs of this launch, so
    their loads skip this SM's L1. SHARED: the row holds a shared expert's gate logit after the E experts', and the
    token gets a (k+1)-th choice, expert E with weight sigmoid(that logit), in rows of k + 1."""
    experts = tl.arange(0, EXPERTS_P)
    real = experts < num_experts
    CACHE: tl.constexpr = ".cg" if LOGITS_FROM_L2 else ""
    logits_row = logits_ptr + token * stride_logits
    raw = tl.load(logits_row + experts, mask=real, other=float("-inf"), cache_modifier=CACHE)
    if SHARED:  # loaded with the experts' logits: after the weights' stores it would cost a round trip of its own
        gate = tl.load(logits_row + num_experts, cache_modifier=CACHE).to(tl.float32)
    logits = raw.to(tl.float32)
    # 16-bit logits (models served in bf16/fp16) are chosen by int32 keys (_choice_keys): one maximum a round, a
    # single warp-reduction instruction. Others by the largest float32 value, then the lowest index holding it.
    KEYED: tl.constexpr = raw.dtype.primitive_bitwidth == 16
    if KEYED:
        keys = tl.where(real, _choice_keys(raw, experts, EXPERTS_P), CLOSED_KEY)
    else:
        remaining = tl.where(real, logits, float("-inf"))
        open_ = real
    slots = tl.arange(0, TOP_K_P)
    chosen_ids = tl.zeros([TOP_K_P], dtype=tl.int32)
    chosen_exps = tl.zeros([TOP_K_P], dtype=tl.float32)
    chosen_total = tl.zeros([], dtype=tl.float32)
    top = 0.0
    for j in tl.static_range(TOP_K):
        if KEYED:
            best = tl.max(keys, axis=0)
            index, value = _from_key(best, raw, EXPERTS_P)
            # The chosen key drops below every open expert's, -inf logits included.
            keys = tl.where(keys == best, CLOSED_KEY, keys)
        else:
            value = tl.max(remaining, axis=0)
            # A chosen expert leaves `open_`: with -inf logits the maximum alone would not tell it from the rest.
            index = tl.min(tl.where((remaining == value) & open_, experts, EXPERTS_P), axis=0)
            remaining = tl.where(experts == index, float("-inf"), remaining)
            open_ = open_ & (experts != index)
        index = tl.minimum(index, num_experts - 1)  # in range whatever the logits (NaN)
        if j == 0:
            top = value  # the largest logit
        chosen_ids = tl.where(slots == j, index, chosen_ids)
        # value is the chosen logit itself, so its exp takes no further reduction.
        chosen = tl.exp(value - top)
        chosen_exps = tl.where(slots == j, chosen, chosen_exps)
        chosen_total += chosen
    if RENORMALIZE:
        total = chosen_total
    else:
        total = _fixed_point_sum(tl.where(real, tl.exp(logits - top), 0.0))
    keep = slots < TOP_K
    row = token * (TOP_K + SHARED)
    tl.store(weights_ptr + row + slots, chosen_exps / total, mask=keep)
    tl.store(ids_ptr + row + slots, chosen_ids.to(ids_ptr.dtype.element_ty), mask=keep)
    if SHARED:
        tl.store(weights_ptr + row + TOP_K, 1.0 / (1.0 + tl.exp(-gate)))
        tl.store(ids_ptr + row + TOP_K, tl.zeros([], dtype=ids_ptr.dtype.element_ty) + num_experts)
    return chosen_ids


@triton.jit
def _choice_keys(raw, experts, EXPERTS_P: tl.constexpr):
    """int32 keys ordered as (logit, -index) over 16-bit logits: the logit's bits made monotonic (a negative
    float's magnitude bits flipped; -0.0 ranks as 0.0) above EXPERTS_P - 1 - index (below 2**15)."""
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
    bits = tl.where(bits == -(2 ** 15), 0, bits)
    ordered = tl.where(bits < 0, bits ^ 0x7FFF, bits)
    return (ordered << 16) | (EXPERTS_P - 1 - experts)


@triton.jit
def _from_key(key, raw, EXPERTS_P: tl.constexpr):
    """(expert index, logit as float32) of a key of _choice_keys."""
    ordered = key >> 16
    bits = tl.where(ordered < 0, ordered ^ 0x7FFF, ordered).to(tl.int16)
    return EXPERTS_P - 1 - (key & 0xFFFF), bits.to(raw.dtype, bitcast=True).to(tl.float32)


@triton.jit
def _fixed_point_sum(exps):
    """The sum of exps [EXPERTS_P] (each in [0, 1], one of them 1, so the sum is at least 1) with the same bits in
    any order of addition: each exp as a whole number of 2^-48 (rounded down, off by less than 2^-48), added exactly
    in int64, the total rounded once to float32."""
    fixed = (exps * FIXED_POINT_ONE).to(tl.int64)
    return tl.sum(fixed, axis=0).to(tl.float32) * (1.0 / FIXED_POINT_ONE)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
                  TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, EXPERTS_P: tl.constexpr, RENORMALIZE: tl.constexpr,
                  SHARED: tl.constexpr, PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    """PDL: launched to overlap the kernel before it (kernels/triton/pdl.py); NEXT_EARLY: the next launches at this
    one's start (pdl.py's early launches)."""
    if NEXT_EARLY:
        launch_next(PDL)
    enter(PDL, NEXT_EARLY)
    route_token(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0).to(tl.int64), num_experts, stride_logits,
                TOP_K, TOP_K_P, EXPERTS_P, RENORMALIZE, False, SHARED)


def routing_outputs(logits: torch.Tensor, top_k: int, shared: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits with unit stride over the experts, empty weights [T, k] float32, empty ids [T, k] int64) after
    checking top_k and the number of experts; with `shared` (the last logit a shared expert's gate) [T, k + 1]."""
    tokens, num_experts = logits.shape
    num_experts -= shared
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the router takes at most {MAX_EXPERTS} experts, got {num_experts}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    choices = top_k + shared
    return (logits, torch.empty(tokens, choices, dtype=torch.float32, device=logits.device),
            torch.empty(tokens, choices, dtype=torch.int64, device=logits.device))


def route_top_k(logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool = False,
                num_warps: int | None = None, next_early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, k] float32, expert ids [T, k] int64), as
    torch.topk(torch.softmax(logits.float(), -1), k) followed, with `renormalize`, by dividing the weights by
    their sum. `shared`: logits [T, E + 1] whose last column is a shared expert's gate, which every token takes
    as its last choice, expert E with weight sigmoid(gate): [T, k + 1] (layers/moe.py's folded shared expert).
    num_warps: the launch's (route_warps unless given; the same results with any). next_early: the experts' kernels
    come next, so they may be placed at this launch's start (kernels/triton/pdl.py's early launches)."""
    tokens, num_experts = logits.shape
    num_experts -= shared
    logits, weights, ids = routing_outputs(logits, top_k, shared)
    if tokens:
        experts_p = triton.next_power_of_2(num_experts)
        _route_kernel[(tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                 TOP_K_P=triton.next_power_of_2(top_k), EXPERTS_P=experts_p,
                                 RENORMALIZE=renormalize, SHARED=shared, num_warps=num_warps or route_warps(experts_p),
                                 **pdl.launch(logits.device, next_early))
    return weights, ids


def route_warps(experts_p: int) -> int:
    """Warps of a routing program over experts_p (a power of two) logits: one warp's registers hold up to 128
    logits in four a thread; past that each round's maximum crosses warps through shared memory. Alone, a choice at
    512 experts took 3.25 us over two warps on an H200 (with the shared gate; 4.55 with one warp, 5.25 with four:
    benchmarks/moe_packed_one_token.py), but in a decode step, with the experts' kernels placed at its start, four
    did best: Qwen3-Next-80B-A3B FP8's batch-1 step 2.1961 ms against 2.2166 over two and 2.2223 over one, the
    same tokens (benchmarks/chain_variants.py; its results:
    benchmarks/results/chain-route-warps-qwen3-next-fp8-block-nvidia-h200-20261202.json). 256 experts keep two."""
    if experts_p <= 128:
        return 1
    return 2 if experts_p <= 256 else 4
