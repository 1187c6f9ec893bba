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

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.communicator import Communicator
from shardserve.layers.deltanet_kernels import DeltaNetKernels, delta_net_kernels
from shardserve.layers.deltanet_projections import ConvWeight, InProjBA, InProjQKVZ, head_vector, qkv_rows
from shardserve.layers.linear import RowParallelLinear
from shardserve.layers.norm import GatedRMSNorm
from shardserve.layers.sharding import delta_net_shard


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


class GatedDeltaNet(nn.Module):
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

    def zero_state(self, batch: int | None = None, device: torch.device | str | None = None) -> DeltaNetState:
        """The state of `batch` sequences (one without a batch dim when None) that have no tokens yet."""
        lead = () if batch is None else (batch,)
        d = self.dims
        return DeltaNetState(
            torch.zeros(*lead, self.channels, d.conv_kernel - 1, dtype=self.dtype, device=device),
            torch.zeros(*lead, self.value_heads, d.key_dim, d.value_dim, dtype=torch.float32, device=device))

    def prefill(self, x: torch.Tensor, state: DeltaNetState | None = None) -> tuple[torch.Tensor, DeltaNetState]:
        """One sequence's next T >= 1 tokens x [T, hidden] from `state` (None: a new sequence).
        Returns (output [T, hidden], the state after them); `state` is not written."""
        state = self.zero_state(device=x.device) if state is None else state
        out, conv, rec = self.mix(x, [0, x.shape[0]], state.conv.unsqueeze(0), state.recurrent.unsqueeze(0))
        return out, DeltaNetState(conv[0], rec[0])

    def decode(self, x: torch.Tensor, states: DeltaNetState) -> tuple[torch.Tensor, DeltaNetState]:
        """One token for each of B sequences at once: x [B, hidden], states with leading dim [B].
        Returns (output [B, hidden], their states after the token); `states` is not written."""
        out, conv, rec = self.mix(x, list(range(x.shape[0] + 1)), states.conv, states.recurrent)
        return out, DeltaNetState(conv, rec)

    def forward(self, x: torch.Tensor, pool: DeltaNetState, slots: torch.Tensor,
                query_start: Sequence[int]) -> torch.Tensor:
        """A step over several sequences whose states live in `pool` (leading dim: slots).

        Sequence i has tokens x[query_start[i]:query_start[i + 1]] (any number >= 1: a prompt chunk or one decode
        token) and its state in pool slot slots[i]. Its slot is read, then overwritten with the state after these
        tokens. Invariant: slots of one step are distinct; a new sequence's slot is zeroed before its first step.
        """
        conv, rec = pool.conv[slots], pool.recurrent[slots]
        out, conv, rec = self.mix(x, query_start, conv, rec)
        pool.conv[slots] = conv
        pool.recurrent[slots] = rec
        return out

    def mix(self, x: torch.Tensor, query_start: Sequence[int], conv: torch.Tensor,
            rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer over sequences laid end to end in x [T, hidden] (sequence i: rows query_start[i] to
        query_start[i + 1]) from their states conv [n, ...] and rec [n, ...]. Returns (output [T, hidden], the
        new conv states, the new recurrent states). Single-token sequences step together (one batched call);
        longer ones run one by one through the chunked kernels."""
        kernels = self.kernels or delta_net_kernels(x.device)
        d, hv = self.dims, self.value_heads
        qkvz = self.in_proj_qkvz(x)
        qkv, z = qkvz.split([self.channels, hv * d.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([hv, hv], dim=-1)
        beta = b.sigmoid().float()
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)
        o = torch.empty(x.shape[0], hv, d.value_dim, dtype=torch.float32, device=x.device)
        new_conv, new_rec = conv.clone(), rec.clone()
        starts = list(query_start)
        singles = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
        if singles:
            rows = torch.tensor([starts[i] for i in singles], device=x.device)
            seqs = torch.tensor(singles, device=x.device)
            mixed, new_conv[seqs] = kernels.conv_step(qkv[rows], weight, conv[seqs])
            q, k, v = self._heads(mixed)
            o[rows], new_rec[seqs] = kernels.rule_step(q, k, v, g[rows], beta[rows], self.scale, rec[seqs])
        for i in range(len(starts) - 1):
            s, e = starts[i], starts[i + 1]
            if e - s > 1:
                mixed, new_conv[i] = kernels.conv(qkv[s:e], weight, conv[i])
                q, k, v = self._heads(mixed)
                o[s:e], new_rec[i] = kernels.rule(q, k, v, g[s:e], beta[s:e], self.scale, rec[i])
        h = self.norm(o.to(x.dtype), z.reshape(-1, hv, d.value_dim))
        return self.out_proj(h.reshape(x.shape[0], -1)), new_conv, new_rec

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (l2-normalised, float32) [tokens, key_heads, key_dim] and v [tokens, value_heads, value_dim] of
        the convolution's output [tokens, channels]."""
        d, hk = self.dims, self.key_heads
        q, k, v = mixed.split([hk * d.key_dim, hk * d.key_dim, self.value_heads * d.value_dim], dim=-1)
        q, k = (_l2_normalized(t.reshape(t.shape[0], hk, d.key_dim).float()) for t in (q, k))
        return q, k, v.reshape(v.shape[0], self.value_heads, d.value_dim)


def _l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, as the reference kernels normalise q and k."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
