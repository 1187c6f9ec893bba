"""Experts without a gate: each expert is down(act(up(x))), act the squared ReLU (relu2) or SiLU, as NemotronH's
are (transformers' NemotronHExperts), unlike the SwiGLU experts of layers/moe.py.

Layout: `w1` [E_held, I_rank, D] holds each held expert's up-projection rows, `w2` [E_held, D, I_rank] the same
features' columns of its down projection; D is the width the experts read and write (the hidden size, or a
LatentMoE's latent size). Which experts and features a rank holds is its ExpertShard (layers/sharding.py): every
expert split by features, whole experts under expert parallelism, or everything whole where the features do not
split; with a sharded layout each rank's output is a partial sum, and the caller all-reduces it.

Checkpoints hold the experts one by one (`experts.{e}.up_proj.weight` [I, D], `experts.{e}.down_proj.weight`
[D, I]) or stacked as transformers keeps them in memory (`experts.up_proj` [E, I, D], `experts.down_proj` [E, D, I]);
the loaders take either (shard ids (expert, None), or "all").

The computation groups the (token, expert) pairs by expert and runs each expert that received tokens on its tokens
at once (layers/moe.grouped_by_expert), reading the counts on the host: not captured by CUDA graphs, on any device
(no fused GPU kernel for this layout yet).
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.layers.linear import as_tensor, empty_parameter
from shardserve.layers.moe import _check_shape, grouped_by_expert
from shardserve.layers.sharding import ExpertShard

ACTIVATIONS = ("relu2", "silu")


def relu2_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One non-gated expert on its tokens with the squared ReLU: w2 relu(w1 x)^2 (w1 [I, D], w2 [D, I])."""
    return F.linear(torch.relu(F.linear(x, w1)).square(), w2)


def silu_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)), w2)


class NonGatedExperts(nn.Module):
    # The expert counts are read on the host (grouped_by_expert): a CUDA graph cannot capture the layer.
    graph_safe = False
    graph_unsafe_reason = "Nemotron's non-gated experts read their token counts on the host"

    def __init__(self, width: int, intermediate_size: int, num_experts: int, shard: ExpertShard, activation: str,
                 dtype: torch.dtype) -> None:
        """width: D, what each expert reads and writes; shard: this rank's experts and features of each."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"non-gated experts with activation {activation!r}: only {ACTIVATIONS} are implemented")
        self.shard, self.width, self.intermediate_size, self.num_experts = shard, width, intermediate_size, num_experts
        self.ffn = relu2_ffn if activation == "relu2" else silu_ffn
        (e0, e1), (r0, r1) = shard.experts, shard.rows
        self.w1 = empty_parameter(e1 - e0, r1 - r0, width, dtype=dtype)
        self.w1.weight_loader = self._load_w1
        self.w2 = empty_parameter(e1 - e0, width, r1 - r0, dtype=dtype)
        self.w2.weight_loader = self._load_w2

    # -- loading: shard_id (expert, None) for one expert's tensor, "all" for every expert's stacked
    def _load_w1(self, param: nn.Parameter, loaded: Any, shard_id: Hashable) -> None:
        (e0, e1), (r0, r1) = self.shard.experts, self.shard.rows
        if shard_id == "all":
            _check_shape(loaded, (self.num_experts, self.intermediate_size, self.width), "experts.up_proj")
            param.data.copy_(as_tensor(loaded[e0:e1, r0:r1]))
            return
        expert, _ = shard_id
        _check_shape(loaded, (self.intermediate_size, self.width), f"expert {expert}'s up projection")
        if e0 <= expert < e1:  # another rank's expert under expert parallelism: not read
            param.data[expert - e0].copy_(as_tensor(loaded[r0:r1]))

    def _load_w2(self, param: nn.Parameter, loaded: Any, shard_id: Hashable) -> None:
        (e0, e1), (r0, r1) = self.shard.experts, self.shard.rows
        if shard_id == "all":
            _check_shape(loaded, (self.num_experts, self.width, self.intermediate_size), "experts.down_proj")
            param.data.copy_(as_tensor(loaded[e0:e1, :, r0:r1]))
            return
        expert, _ = shard_id
        _check_shape(loaded, (self.width, self.intermediate_size), f"expert {expert}'s down projection")
        if e0 <= expert < e1:
            param.data[expert - e0].copy_(as_tensor(loaded[:, r0:r1]))

    # -- computation
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over this rank's experts and features: x [T, D], weights and
        ids [T, k] (global expert ids; other ranks' experts add nothing). A partial sum where shard.sharded."""
        e0 = self.shard.experts[0]
        local = ids - e0 if e0 else ids
        return grouped_by_expert(x, self.w1.shape[0], lambda e: (self.w1[e], self.w2[e]), weights, local, self.ffn)
