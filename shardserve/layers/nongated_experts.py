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

On GPUs the fused Triton kernel (kernels/triton/fused_moe.py with the layer's activation: no host synchronisation,
so CUDA graphs capture the layer) computes it, once it has matched a float64 reference on random inputs at every
token count that picks another kernel config (checked once per device, shapes, top k, activation and dtype).
Elsewhere, or where it does not match (logged), the (token, expert) pairs are grouped by expert and each expert
that received tokens runs on its tokens at once (layers/moe.grouped_by_expert), reading the counts on the host: not
captured by CUDA graphs. A quantized checkpoint's experts (NVFP4, FP8, GPTQ) stay packed as SwiGLU experts do
(layers/moe_packed.py: `packed`), on the same kernels with the layer's activation.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

import torch
from torch import nn

from shardserve import envs
from shardserve.layers.linear import as_tensor, empty_parameter, materialized, weights_device
from shardserve.layers.moe import EXPERT_FFNS, _check_shape, check_routes, close_to_float64, grouped_by_expert
from shardserve.layers.sharding import ExpertShard

ACTIVATIONS = ("relu2", "silu")
logger = logging.getLogger(__name__)


_fused_checked: dict[tuple, bool] = {}


def fused_matches(w1: torch.Tensor, w2: torch.Tensor, top_k: int, activation: str) -> bool:
    """Whether the fused kernel computes these experts' shapes on this GPU within tolerance of float64 (random
    weights of the layer's shapes; the real ones may not be loaded yet), checked once per key."""
    if not w1.is_cuda or not envs.DEVICE_EXPERTS.get():
        return False
    key = (w1.device, tuple(w1.shape), tuple(w2.shape), w1.dtype, top_k, activation)
    if key not in _fused_checked:
        from shardserve.kernels.triton.fused_moe import fused_moe

        g = torch.Generator(device=w1.device).manual_seed(0)
        a = torch.randn(w1.shape, generator=g, device=w1.device).mul_(0.05).to(w1.dtype)
        b = torch.randn(w2.shape, generator=g, device=w1.device).mul_(0.05).to(w1.dtype)
        ffn = EXPERT_FFNS[activation]
        what = f"non-gated {activation} experts of shape {tuple(w1.shape)} on {w1.device}"
        _fused_checked[key] = all(
            close_to_float64("fused_moe", what, tokens, w1.dtype,
                             lambda: fused_moe(x, a, b, weights, ids, activation=activation),
                             lambda: grouped_by_expert(x.double(), a.shape[0], lambda e: (a[e].double(), b[e].double()),
                                                       weights.double(), ids, ffn))
            for tokens, x, weights, ids in check_routes(w1.shape[0], w1.shape[2], top_k, w1.dtype, w1.device, g))
        if not _fused_checked[key]:
            logger.warning("%s run grouped by expert with the counts read on the host: no CUDA graphs", what)
    return _fused_checked[key]


class NonGatedExperts(nn.Module):
    graph_unsafe_reason = "Nemotron's non-gated experts without their fused kernel read their token counts on the host"
    up_name = "w1"  # its experts' up weight (layers/moe_packed.py)

    def __init__(self, width: int, intermediate_size: int, num_experts: int, top_k: int, shard: ExpertShard,
                 activation: str, dtype: torch.dtype) -> None:
        """width: D, what each expert reads and writes; top_k: the experts a token chooses; shard: this rank's
        experts and features of each."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"non-gated experts with activation {activation!r}: only {ACTIVATIONS} are implemented")
        self.shard, self.width, self.intermediate_size, self.num_experts = shard, width, intermediate_size, num_experts
        self.activation, self.top_k = activation, top_k
        self.ffn = EXPERT_FFNS[activation]
        (e0, e1), (r0, r1) = shard.experts, shard.rows
        # Under deferred_weights() the experts wait on the meta device until they are packed or materialized.
        device = weights_device()
        self.w1 = empty_parameter(e1 - e0, r1 - r0, width, dtype=dtype, device=device)
        self.w1.weight_loader = self._load_w1
        self.w2 = empty_parameter(e1 - e0, width, r1 - r0, dtype=dtype, device=device)
        self.w2.weight_loader = self._load_w2
        self.packed = None  # a quantized checkpoint's experts kept packed (layers/moe_packed.ExpertPacking)

    # What layers/moe_packed.py reads of a block of experts, named as SparseMoE names them.
    @property
    def rows(self) -> tuple[int, int]:
        return self.shard.rows

    @property
    def experts_held(self) -> tuple[int, int]:
        return self.shard.experts

    @property
    def hidden_size(self) -> int:
        return self.width

    @property
    def choices(self) -> int:
        return self.top_k

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids as this rank's slots (other ranks' experts fall outside [0, E_held))."""
        e0 = self.shard.experts[0]
        return ids - e0 if e0 else ids

    def slot(self, expert: int) -> int | None:
        """Where checkpoint expert `expert` lives in w1/w2, or None where another rank holds it."""
        e0, e1 = self.shard.experts
        return expert - e0 if e0 <= expert < e1 else None

    def materialize(self, device) -> None:
        """Give experts built under deferred_weights() their real (empty) weights on `device`."""
        self.w1, self.w2 = materialized(self.w1, device), materialized(self.w2, device)

    # -- loading: shard_id (expert, None) for one expert's tensor, "all" for every expert's stacked
    def _load_w1(self, param: nn.Parameter, loaded: Any, shard_id: Hashable) -> None:
        if self.packed is not None:
            return self.packed.load(self, "w1", loaded, shard_id)
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
        if self.packed is not None:
            return self.packed.load(self, "w2", loaded, shard_id)
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
    @property
    def graph_safe(self) -> bool:
        """Whether the fused kernel computes the layer (no host synchronisation: CUDA graphs capture it)."""
        if self.packed is not None:
            return self.packed.graph_safe(self)
        return fused_matches(self.w1, self.w2, self.top_k, self.activation)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over this rank's experts and features: x [T, D], weights and
        ids [T, k] (global expert ids; other ranks' experts add nothing). A partial sum where shard.sharded."""
        local = self.local_ids(ids)
        if self.packed is not None:
            return self.packed.experts(self, x, weights, local)
        if fused_matches(self.w1, self.w2, ids.shape[1], self.activation):
            from shardserve.kernels.triton.fused_moe import fused_moe

            return fused_moe(x, self.w1, self.w2, weights, local, activation=self.activation)
        return grouped_by_expert(x, self.w1.shape[0], lambda e: (self.w1[e], self.w2[e]), weights, local, self.ffn)
