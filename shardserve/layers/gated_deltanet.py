"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5: linear attention with a per-sequence state.

For each token x: [q | k | v | z] = in_proj_qkvz(x), [b | a] = in_proj_ba(x); q, k, v pass through a short causal
depthwise convolution with SiLU (conv1d); q and k are l2-normalised per head; beta = sigmoid(b) and the log decay
g = -exp(A_log) * softplus(a + dt_bias) per value head; the gated delta rule (kernels/gated_delta_rule.py) turns
q, k, v, g, beta into o per value head; the output is out_proj(norm(o) * silu(z)), the norm per head.

A sequence's state is a DeltaNetState: the convolution's last inputs and the delta rule's matrices. Tensor
parallel: each rank owns whole key-head groups (layers/sharding.DeltaNetShard); everything up to out_proj is
local to its heads, and out_proj sums the ranks' shares (row-parallel, one all-reduce). Every per-head size
below (channels, value heads) is this rank's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from shardserve.distributed.communicator import Communicator
from shardserve.kernels.gated_delta_rule import delta_rule_gates, split_heads
from shardserve.layers.deltanet_kernels import DeltaNetKernels, delta_net_kernels
from shardserve.layers.deltanet_projections import ConvWeight, InProjBA, InProjQKVZ, head_vector, qkv_rows
from shardserve.layers.linear import RowParallelLinear
from shardserve.layers.norm import GatedRMSNorm
from shardserve.layers.sharding import delta_net_shard
from shardserve.layers.state_mixer import StateMixer


@dataclass(frozen=True)
class DeltaNetDims:
    """A Gated DeltaNet layer's sizes, whole (not per rank), as config.json gives them."""

    hidden_size: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "DeltaNetDims":
        """From a Qwen3-Next config.json, or a Qwen3.5 one (whose text model's sizes are in text_config)."""
        cfg = cfg.get("text_config") or cfg
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Gated DeltaNet with hidden_act={act!r}: only 'silu' is implemented")
        return cls(cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                   cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"],
                   cfg.get("rms_norm_eps", 1e-6))


class DeltaNetState(NamedTuple):
    """The state of sequences after their tokens so far; zeros for a sequence with none.

    conv: [..., channels, conv_kernel - 1], the layer's dtype: the last inputs of the convolution, oldest first.
    recurrent: [..., value_heads, key_dim, value_dim], float32: the delta rule's matrix of each value head.
    The leading dims are none for one sequence, [B] for a batch, [slots] for a pool of states.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


class GatedDeltaNet(StateMixer):
    # Checkpoint tensors stored apart (Qwen3.5) that land in one local parameter: name -> (parameter, shard id).
    # Qwen3-Next's in_proj_qkvz and in_proj_ba keep their names (shard id None: interleaved per key-head group).
    packed_modules = {
        "in_proj_qkv": ("in_proj_qkvz", "qkv"),
        "in_proj_z": ("in_proj_qkvz", "z"),
        "in_proj_b": ("in_proj_ba", "b"),
        "in_proj_a": ("in_proj_ba", "a"),
    }

    def __init__(self, dims: DeltaNetDims, comm: Communicator, dtype: torch.dtype,
                 kernels: DeltaNetKernels | None = None) -> None:
        """kernels: how the convolution and the delta rule run; by default delta_net_kernels(the input's device)."""
        super().__init__()
        shard = delta_net_shard(dims.key_heads, dims.value_heads, dims.key_dim, dims.value_dim, comm.rank,
                                comm.world_size)
        self.dims, self.shard, self.dtype = dims, shard, dtype
        self.key_heads, self.value_heads = shard.num_key, shard.num_value
        self.channels = 2 * self.key_heads * dims.key_dim + self.value_heads * dims.value_dim
        self.scale = dims.key_dim ** -0.5
        self.in_proj_qkvz = InProjQKVZ(dims.hidden_size, dims.key_heads, dims.key_dim, dims.value_dim, shard, dtype)
        self.in_proj_ba = InProjBA(dims.hidden_size, shard, dtype)
        self.conv1d = ConvWeight(qkv_rows(dims.key_heads, dims.key_dim, dims.value_dim, shard), dims.conv_kernel,
                                 dtype)
        # The decay's parameters stay float32 whatever the model's dtype: g is computed in float32.
        self.A_log = head_vector(shard.value_heads, torch.float32)
        self.dt_bias = head_vector(shard.value_heads, torch.float32)
        self.norm = GatedRMSNorm(dims.value_dim, dims.eps, dtype)
        v0, v1 = shard.value_heads
        self.out_proj = RowParallelLinear((v0 * dims.value_dim, v1 * dims.value_dim), dims.hidden_size, False,
                                          dtype, comm if shard.sharded else None)
        for linear in (self.in_proj_qkvz, self.in_proj_ba, self.out_proj):
            linear.replicated = not shard.sharded
        self.kernels = kernels

    def _kernels(self, device: torch.device) -> DeltaNetKernels:
        return self.kernels or delta_net_kernels(device)

    @property
    def graph_safe(self) -> bool:
        """Whether CUDA graphs can capture its decode step: its kernels skip a padding row's slot -1."""
        return self._kernels(self.A_log.device).graph_safe

    @property
    def graph_unsafe_reason(self) -> str:
        return (f"the Gated DeltaNet decode step of the {self._kernels(self.A_log.device).name} kernels would step "
                f"the last state slot for a graph's padding rows")

    def zero_state(self, batch: int | None = None, device: torch.device | str | None = None) -> DeltaNetState:
        """The state of `batch` sequences (one without a batch dim when None) that have no tokens yet."""
        lead = () if batch is None else (batch,)
        d = self.dims
        return DeltaNetState(
            torch.zeros(*lead, self.channels, d.conv_kernel - 1, dtype=self.dtype, device=device),
            torch.zeros(*lead, self.value_heads, d.key_dim, d.value_dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, pool: DeltaNetState, slots: torch.Tensor,
                query_start: Sequence[int] | None) -> torch.Tensor:
        """A step over several sequences whose states live in `pool` (leading dim: slots), stepped in place.

        Sequence i has tokens x[query_start[i]:query_start[i + 1]] (any number >= 1: a prompt chunk or one decode
        token) and its state in pool slot slots[i]; query_start None: one token each (a decode step, which takes
        only tensors, so it runs inside CUDA graphs). Invariant: slots of one step are distinct; a new
        sequence's slot is zeroed before its first step.
        """
        kernels = self._kernels(x.device)
        d, hv = self.dims, self.value_heads
        qkv, z = self.in_proj_qkvz(x).split([self.channels, hv * d.value_dim], dim=-1)
        ba = self.in_proj_ba(x)
        weight = self.conv1d.weight.squeeze(1)
        layer = dict(conv_weight=weight, a_log=self.A_log, dt_bias=self.dt_bias, scale=self.scale,
                     key_heads=self.key_heads, conv_pool=pool.conv, rec_pool=pool.recurrent)
        if query_start is None:
            normed = kernels.step_and_norm_in_pool(qkv, ba, z, norm_weight=self.norm.weight, eps=self.norm.eps,
                                                   slots=slots, **layer)
        else:
            step = functools.partial(kernels.step_in_pool, **layer)
            o = self._chunks(kernels, step, qkv, ba, weight, pool, slots, list(query_start))
            normed = self.norm.forward_rows(o, z)
        return self.out_proj(normed)

    def _chunks(self, kernels: DeltaNetKernels, step, qkv, ba, weight, pool: DeltaNetState, slots: torch.Tensor,
                starts: list[int]) -> torch.Tensor:
        """The delta rule's output for sequences of any lengths: single tokens step together (one batched call),
        longer chunks run one by one through the chunked kernels; every state stepped in its slot."""
        o = torch.empty(qkv.shape[0], self.value_heads, self.dims.value_dim, dtype=torch.float32, device=qkv.device)
        singles = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
        if singles:
            rows = torch.tensor([starts[i] for i in singles], device=qkv.device)
            o[rows] = step(qkv[rows], ba[rows], slots=slots[torch.tensor(singles, device=qkv.device)])
        g, beta = delta_rule_gates(ba, self.A_log, self.dt_bias)
        d = self.dims
        for i in range(len(starts) - 1):
            s, e = starts[i], starts[i + 1]
            if e - s > 1:
                slot = slots[i:i + 1]  # a tensor index: no host sync
                mixed, conv = kernels.conv(qkv[s:e], weight, pool.conv[slot][0])
                q, k, v = split_heads(mixed, self.key_heads, d.key_dim, self.value_heads, d.value_dim)
                o[s:e], rec = kernels.rule(q, k, v, g[s:e], beta[s:e], self.scale, pool.recurrent[slot][0])
                pool.conv[slot], pool.recurrent[slot] = conv.unsqueeze(0), rec.unsqueeze(0)
        return o
