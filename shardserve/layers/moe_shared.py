"""A gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5) folded into its block's experts after loading.

Every token takes the shared expert, scaled by sigmoid(shared_expert_gate(h)). Computed apart, that is a GEMV pair,
a SwiGLU, a one-output GEMV, a sigmoid, a product and a sum a layer: at batch-1 decode about ten launches of a few
microseconds each on 48 layers. Where the shared expert has the routed experts' size, split and weight layout, it
becomes expert E of w13/w2 (an E+1-th slot) and its gate the router's row E: the router's launch then makes the
gate's logit beside the experts', the choice gives every token a (k+1)-th choice, expert E with weight
sigmoid(logit E) (moe_router.route_top_k / SparseMoE.route), and the experts' own kernels compute it with the
others. The sum is the same up to rounding: the fused kernels round each choice's output to the activations' dtype
and add the choices in float32, as for the routed experts.

Not folded (the block computes the shared expert apart, as before): expert parallelism (the slot would be one
rank's), a shared expert of another size or split than the experts', or another weight layout (16-bit beside
packed experts, another packing or group, act order), or SHARDSERVE_FOLD_SHARED_EXPERT=0.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardserve import envs
from shardserve.layers.moe import SHARED, SparseMoE

logger = logging.getLogger(__name__)

FOLD_ENV = envs.FOLD_SHARED_EXPERT.name  # "0": shared experts computed apart
SHARED_GATE = "shared expert gate"  # the router's shard id of the folded gate's row


def fold_shared_experts(model: nn.Module, log: bool = True) -> int:
    """Fold every foldable shared expert of the model into its block (fold_shared_expert); returns how many."""
    if not envs.FOLD_SHARED_EXPERT.get():
        return 0
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoE)
              and m.shared_expert is not None]
    # Later loads into the same model (a wake from level 2, a reload) find the shared experts' tensors here.
    redirects = getattr(model, "folded_parameters", {})
    folded, why_not = 0, set()
    for name, moe in blocks:
        why = unfoldable(moe)
        if why:
            why_not.add(why)
            continue
        fold_shared_expert(moe)
        redirects.update({
            f"{name}.shared_expert.gate_up_proj.weight": (f"{name}.w13", {0: (SHARED, 0), 1: (SHARED, 1)}),
            f"{name}.shared_expert.down_proj.weight": (f"{name}.w2", {None: (SHARED, None)}),
            f"{name}.shared_expert_gate.weight": (f"{name}.gate.weight", {None: SHARED_GATE})})
        folded += 1
        if moe.w13.is_cuda:  # the experts' old tensors, one block at a time, not cached a block each
            torch.cuda.empty_cache()
    if folded:
        model.folded_parameters = redirects
    if log and folded:
        logger.info("%d of %d shared experts are computed as one more expert of their block (%s=0: apart)", folded,
                    len(blocks), FOLD_ENV)
    if log and why_not:
        logger.info("shared experts computed apart: %s", "; ".join(sorted(why_not)))
    return folded


def unfoldable(moe: SparseMoE) -> str:
    """Why this block's shared expert cannot be one of its experts ("" where it can)."""
    mlp, gate = moe.shared_expert, moe.shared_expert_gate
    if moe.experts_held != (0, moe.num_experts):
        return "expert parallelism"
    if not moe.shared_like_experts:
        return "the shared expert's features are not split as the experts'"
    if moe.gate.bias is not None or moe.gate.packed is not None or gate.packed is not None or gate.bias is not None:
        return "a quantized or biased router"
    up, down = mlp.gate_up_proj, mlp.down_proj
    if moe.packed is None:
        if up.packed is not None or down.packed is not None or up.weight.dtype != moe.w13.dtype:
            return "packed shared expert beside 16-bit experts"
        return ""
    if up.packed is None or down.packed is None:
        return "16-bit shared expert beside packed experts"
    if any(getattr(layer, "input_perm", None) is not None for layer in (up, down)):
        return "an act-order shared expert"
    packing = moe.packed
    if (up.packed.layout.kind, down.packed.layout.kind) != (packing.kind, packing.kind) or \
            (up.packed.group, down.packed.group) != (packing.group13, packing.group2):
        return "a shared expert packed otherwise than the experts"
    return ""


def fold_shared_expert(moe: SparseMoE) -> None:
    """Make the shared expert expert E of moe's w13/w2 (their scales too where packed) and its gate the router's
    row E; the shared expert's own modules go. Call after loading (unfoldable(moe) == "")."""
    mlp, gate = moe.shared_expert, moe.shared_expert_gate
    up, down = mlp.gate_up_proj, mlp.down_proj
    moe.w13 = _with_slot(moe.w13, up.weight.data)
    moe.w2 = _with_slot(moe.w2, down.weight.data)
    if moe.packed is not None:
        moe.w13_scale = _with_slot(moe.w13_scale, up.weight_scale.data)
        moe.w2_scale = _with_slot(moe.w2_scale, down.weight_scale.data)
        if getattr(moe, "w13_row_scale", None) is not None:
            moe.w13_row_scale = _with_slot(moe.w13_row_scale, up.weight_row_scale.data)
            moe.w2_row_scale = _with_slot(moe.w2_row_scale, down.weight_row_scale.data)
    router = moe.gate
    router.weight = _param_like(router.weight, torch.cat([router.weight.data, gate.weight.data.to(router.weight.dtype)]))
    router.offsets[SHARED_GATE] = (router.output_size, (0, 1))
    router.output_size += 1
    moe.shared_expert = moe.shared_expert_gate = None
    moe.shared_folded = True


def _with_slot(param: nn.Parameter, extra: torch.Tensor) -> nn.Parameter:
    """param [E, ...] with `extra` as its slot E: [E + 1, ...]."""
    grown = torch.empty((param.shape[0] + 1, *param.shape[1:]), dtype=param.dtype, device=param.device)
    grown[:-1].copy_(param.data)
    grown[-1].copy_(extra)
    return _param_like(param, grown)


def _param_like(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter holding `data` with param's attributes (its weight_loader)."""
    grown = nn.Parameter(data, requires_grad=False)
    grown.__dict__.update(param.__dict__)
    return grown
