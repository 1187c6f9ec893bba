"""A non-gated shared expert computed as more choices of its block's packed 4-bit experts at batch 1
(kernels/triton/moe_four_bit.py's SharedSlots).

Computed apart, NemotronH's shared expert is a GEMV, a squared ReLU (two launches), a GEMV and a sum a layer. Its
features are a multiple of the routed experts' (Nemotron-3-Nano: 3712 = 2 x 1856) and the squared ReLU acts on each
feature alone, so slot j of its features j * I ... (j + 1) * I is one more expert of weight 1: the experts' two
launches compute it with the routed choices, reading the shared expert's own packed tensors in place (its down
projection's columns by a row stride, nothing copied: a reload at wake-up writes where the kernels read).

Taken where: one token on a GPU whose packed experts run the fused kernels (their start-up check passed) and take
4-bit float16 pair sums there (moe_packed.four_bit_one_token: not with SHARDSERVE_MOE_ONE_TOKEN=gemm), no latent
projections, every rank adding its own share of the shared expert, the shared expert packed as the experts are
(kind and groups, no bias or act order), and SHARDSERVE_FOLD_SHARED_EXPERT not 0. Elsewhere the block computes it
apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardserve import envs
from shardserve.layers.moe_packed import four_bit_one_token, one_token_four_bit
from shardserve.layers.nongated_experts import NonGatedExperts

if TYPE_CHECKING:
    from shardserve.kernels.triton.moe_four_bit import SharedSlots


def shared_slots(experts: NonGatedExperts, up: nn.Module, down: nn.Module, h: torch.Tensor) -> SharedSlots | None:
    """The shared expert (up, down: its packed linear layers) as slots of the experts' one-token kernels for h, or
    None where the block computes it apart."""
    packing = experts.packed
    if h.shape[0] != 1 or packing is None or not envs.FOLD_SHARED_EXPERT.get() or not packing.graph_safe(experts):
        return None
    from shardserve.kernels.triton.moe_four_bit import SharedSlots, shared_slots_fit

    view = packing.view(experts)
    if not four_bit_one_token(h, view):  # the experts' own launches are not moe_four_bit's
        return None
    if any(layer.packed is None or getattr(layer, "input_perm", None) is not None or layer.bias is not None
           for layer in (up, down)):
        return None
    if (up.packed.layout.kind, down.packed.layout.kind, up.packed.group, down.packed.group) != (
            view.kind, view.kind, view.group13, view.group2):
        return None
    tensors = (up.weight, up.weight_scale, down.weight, down.weight_scale)
    rows = (getattr(up, "weight_row_scale", None), getattr(down, "weight_row_scale", None))
    slots = shared_slots_fit(view, *tensors, *rows)
    return SharedSlots(*tensors, slots, *rows) if slots else None


def experts_with_shared(experts: NonGatedExperts, slots: SharedSlots, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
    """NonGatedExperts.forward plus the shared expert's slots, in the experts' two launches. x is the block's normed
    hidden state, written by the norm's launch before the router's (its GEMV and its choice): two or more launches
    before the experts', which may then read it before their dependent-launch wait (pdl.py's rule)."""
    return one_token_four_bit(x, experts.packed.view(experts), weights, experts.local_ids(ids), shared=slots,
                              h_early=True)
