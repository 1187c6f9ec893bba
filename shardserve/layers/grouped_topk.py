"""Grouped top-k routing with sigmoid scores and a score-correction bias: NemotronH's mixture of experts (transformers'
NemotronHTopkRouter), and DeepSeek-V3's, which routes the same way; and DeepSeek-V2's with softmax scores.

For each token: scores = sigmoid(router logits), in float32. The experts are chosen on scores + bias (the checkpoint's
`e_score_correction_bias`, which balances the experts' load): the experts fall into `num_groups` equal groups in order,
a group's worth is the sum of its two best biased scores, the `topk_groups` best groups stay, and the top_k best
biased scores among their experts are the choice. The weights are the chosen experts' unbiased scores, divided by
their sum (+ 1e-20) where `renormalize`, then times `scaling_factor`. The bias only chooses; it never weighs.

Softmax scoring (DeepSeek-V2's greedy and group_limited_greedy): scores = softmax(logits) over all experts, no
bias, a group's worth is its best score, and the chosen scores are the weights (renormalised only where `renormalize`).

The router is replicated: every rank routes every token to the same experts, whatever it holds of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.config import GroupedTopK
from shardserve.layers.linear import empty_parameter, load_whole


def grouped_top_k(logits: torch.Tensor, correction_bias: torch.Tensor | None,
                  route: GroupedTopK) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) for router logits [T, num_experts], as the module's
    docstring says; the ids in no particular order (their weights beside them)."""
    softmax = route.scoring == "softmax"
    scores = logits.float().softmax(dim=-1) if softmax else logits.float().sigmoid()
    for_choice = scores if correction_bias is None else scores + correction_bias.float()
    if route.num_groups > 1:
        tokens = for_choice.shape[0]
        grouped = for_choice.view(tokens, route.num_groups, -1)
        worth = grouped.amax(dim=-1) if softmax else grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        kept = worth.topk(route.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, kept, True)
        for_choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)
    ids = for_choice.topk(route.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if route.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route.scaling_factor, ids


class GroupedTopKRouter(nn.Module):
    """The router of a grouped top-k mixture of experts: `weight` [E, H] and `e_score_correction_bias` [E], both
    float32 whatever the model's dtype (transformers keeps them so), whole on every rank; the logits are computed in
    float32. Checkpoint names: `gate.weight`, `gate.e_score_correction_bias` (none with `correction_bias` False:
    DeepSeek-V2's softmax routing)."""

    # Whole on every rank: the ranks compare its parameters after loading (weights/consistency.py).
    replicated = True

    def __init__(self, hidden_size: int, route: GroupedTopK, correction_bias: bool = True) -> None:
        super().__init__()
        self.route = route
        self.weight = empty_parameter(route.num_experts, hidden_size, dtype=torch.float32)
        self.weight.weight_loader = load_whole
        self.e_score_correction_bias = None
        if correction_bias:
            self.e_score_correction_bias = empty_parameter(route.num_experts, dtype=torch.float32)
            self.e_score_correction_bias.weight_loader = load_whole

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, expert ids [T, top_k]) for the normed hidden states h [T, H]."""
        logits = F.linear(h.float(), self.weight)
        return grouped_top_k(logits, self.e_score_correction_bias, self.route)
