"""The Mamba-2 token mixer of NemotronH: a selective state-space layer with a per-sequence state.

For each token x: [z | x' | B | C | dt] = in_proj(x); [x' | B | C] passes through a short causal depthwise
convolution (with bias where the checkpoint has one) and SiLU; dt = softplus(dt + dt_bias) clamped to
time_step_limit; the SSD recurrence (kernels/mamba2_ssd.py) with A = -exp(A_log) and the skip D turns x', B, C,
dt into y per head; the output is out_proj(norm(y * silu(z))), the RMS norm taken over each of the n_groups
groups of heads apart.

The convolution and the SSM run through the device's Mamba2Kernels (layers/mamba2_kernels.py): on CUDA GPUs with
Triton a decode step steps the states in their pool slots in two kernels and takes only tensors, so decode runs
inside CUDA graphs; prompt chunks run the torch forms.

A sequence's state is a MambaState: the convolution's last inputs and the SSM state of each head. Tensor
parallel: each rank owns whole B/C groups and their heads (layers/sharding.MambaShard); everything up to out_proj
is local, and out_proj sums the ranks' shares (row-parallel, one all-reduce). Every per-head size below (channels,
heads, groups) is this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Sequence

import torch
from torch import nn

from shardserve.config import _json_float
from shardserve.distributed.communicator import Communicator
from shardserve.kernels.mamba2_ssd import step_sizes
from shardserve.layers.deltanet_projections import ConvWeight, head_vector
from shardserve.layers.linear import ColumnParallelLinear, RowParallelLinear, copy_exact, empty_parameter
from shardserve.layers.mamba2_kernels import Mamba2Kernels, mamba2_kernels, split_channels
from shardserve.layers.sharding import MambaShard, mamba_shard
from shardserve.layers.state_mixer import StateMixer

Rows = tuple[int, int]


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 layer's sizes, whole (not per rank), as config.json gives them."""

    hidden_size: int
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    chunk_size: int
    eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    proj_bias: bool = False

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "Mamba2Dims":
        """From a NemotronH config.json (its current keys, or the older mamba_* ones)."""
        act = cfg.get("mamba_hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Mamba-2 with mamba_hidden_act={act!r}: only 'silu' is implemented")
        limit = cfg.get("time_step_limit", cfg.get("mamba_dt_limit")) or (0.0, float("inf"))
        return cls(cfg["hidden_size"], cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"],
                   cfg.get("n_groups", cfg.get("mamba_n_groups", 8)), cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
                   cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128)), cfg.get("layer_norm_epsilon", 1e-5),
                   (_json_float(limit[0]), _json_float(limit[1])), bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
                   bool(cfg.get("use_bias", False)))


class MambaState(NamedTuple):
    """The state of sequences after their tokens so far; zeros for a sequence with none.

    conv: [..., channels, conv_kernel - 1], the layer's dtype: the last inputs of the convolution, oldest first.
    ssm: [..., heads, head_dim, state_size], float32: each head's state matrix.
    The leading dims are none for one sequence, [B] for a batch, [slots] for a pool of states.
    """

    conv: torch.Tensor
    ssm: torch.Tensor


def _conv_rows(d: Mamba2Dims, shard: MambaShard) -> dict[str, Rows]:
    """Rows of this rank's x, B and C in the convolution's channels [x | B | C] (and in in_proj after z)."""
    (h0, h1), (g0, g1) = shard.heads, shard.groups
    p, n, inner, bc = d.head_dim, d.state_size, d.inner, d.groups * d.state_size
    return {"x": (h0 * p, h1 * p), "B": (inner + g0 * n, inner + g1 * n), "C": (inner + bc + g0 * n, inner + bc + g1 * n)}


class InProj(ColumnParallelLinear):
    """Local rows [z | x | B | C | dt] of this rank's heads and groups, read from the checkpoint's one in_proj
    tensor [z | x | B | C | dt] (each part a range of its rows)."""

    def __init__(self, d: Mamba2Dims, shard: MambaShard, dtype: torch.dtype) -> None:
        (h0, h1), inner = shard.heads, d.inner
        conv = {k: (inner + s, inner + e) for k, (s, e) in _conv_rows(d, shard).items()}
        dt0 = 2 * inner + 2 * d.groups * d.state_size
        parts = {"z": (h0 * d.head_dim, h1 * d.head_dim), **conv, "dt": (dt0 + h0, dt0 + h1)}
        super().__init__(d.hidden_size, parts, d.proj_bias, dtype)

    def _load_rows(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        for part in (self.offsets if shard_id is None else (shard_id,)):
            super()._load_rows(param, loaded, part)


def _row_vector(rows: list[Rows], dtype: torch.dtype) -> nn.Parameter:
    """A parameter holding the checkpoint vector's `rows` ranges stacked (the conv bias, the norm's weight)."""
    param = empty_parameter(sum(e - s for s, e in rows), dtype=dtype)

    def load(p: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        offset = 0
        for s, e in rows:
            copy_exact(p.data[offset:offset + e - s], loaded[s:e])
            offset += e - s

    param.weight_loader = load
    return param


class GroupedGatedRMSNorm(nn.Module):
    """norm(y * silu(z)) with the RMS taken over each group of `group_size` features apart, in float32, then
    scaled by the weight in the output dtype (NemotronH's RMSNormGated, norm after the gate), computed by the
    layer's kernels (Mamba2Kernels.norm). A rank owns whole groups, so its norm needs nothing from the others."""

    def __init__(self, rows: Rows, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = _row_vector([rows], dtype)

    def forward(self, y: torch.Tensor, gate: torch.Tensor, kernels: Mamba2Kernels) -> torch.Tensor:
        """y [rows, features] (float32), gate [rows, features] (rows may be strided) -> [rows, features] in the
        weight's dtype."""
        return kernels.norm(y, gate, self.weight, self.group_size, self.eps)


class Mamba2Mixer(StateMixer):
    def __init__(self, dims: Mamba2Dims, comm: Communicator, dtype: torch.dtype,
                 ssm_dtype: torch.dtype = torch.float32, kernels: Mamba2Kernels | None = None) -> None:
        """ssm_dtype: how the SSM states are kept between steps (the recurrence itself runs in float32); kernels:
        how the convolution and the SSM run, by default mamba2_kernels(the input's device)."""
        super().__init__()
        shard = mamba_shard(dims.heads, dims.groups, dims.head_dim, comm.rank, comm.world_size)
        self.dims, self.shard, self.dtype, self.ssm_dtype = dims, shard, dtype, ssm_dtype
        self.heads, self.groups = shard.num_heads, shard.num_groups
        self.inner = self.heads * dims.head_dim
        self.channels = self.inner + 2 * self.groups * dims.state_size
        self.in_proj = InProj(dims, shard, dtype)
        conv_rows = _conv_rows(dims, shard)
        self.conv1d = ConvWeight(conv_rows, dims.conv_kernel, dtype)
        if dims.conv_bias:
            self.conv1d.bias = _row_vector(list(conv_rows.values()), dtype)
        else:
            self.conv1d.bias = None
        # A, D and the step's bias stay float32 whatever the model's dtype, as the reference computes with them.
        self.A_log = head_vector(shard.heads, torch.float32)
        self.D = head_vector(shard.heads, torch.float32)
        self.dt_bias = head_vector(shard.heads, torch.float32)
        h0, h1 = shard.heads
        self.norm = GroupedGatedRMSNorm((h0 * dims.head_dim, h1 * dims.head_dim), dims.inner // dims.groups,
                                        dims.eps, dtype)
        self.out_proj = RowParallelLinear((h0 * dims.head_dim, h1 * dims.head_dim), dims.hidden_size,
                                          dims.proj_bias, dtype, comm if shard.sharded else None)
        self.in_proj.replicated = self.out_proj.replicated = not shard.sharded
        self.kernels = kernels

    def _kernels(self, device: torch.device) -> Mamba2Kernels:
        return self.kernels or mamba2_kernels(device)

    @property
    def graph_safe(self) -> bool:
        """Whether CUDA graphs can capture its decode step: its kernels skip a padding row's slot -1."""
        return self._kernels(self.D.device).graph_safe

    @property
    def graph_unsafe_reason(self) -> str:
        return (f"the Mamba-2 decode step of the {self._kernels(self.D.device).name} kernels would step the last "
                f"state slot for a graph's padding rows")

    def zero_state(self, batch: int | None = None, device: torch.device | str | None = None,
                   ssm_dtype: torch.dtype | None = None) -> MambaState:
        """The state of `batch` sequences (one without a batch dim when None) that have no tokens yet, its SSM state
        in ssm_dtype (None: the layer's). The steps keep whatever dtype the state they are given has."""
        lead = () if batch is None else (batch,)
        d = self.dims
        return MambaState(
            torch.zeros(*lead, self.channels, d.conv_kernel - 1, dtype=self.dtype, device=device),
            torch.zeros(*lead, self.heads, d.head_dim, d.state_size, dtype=ssm_dtype or self.ssm_dtype, device=device))

    def _step(self, kernels: Mamba2Kernels, xbc: torch.Tensor, dt: torch.Tensor, pool: MambaState,
              slots: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences (dt before softplus), their states stepped in their slots; y [B, heads,
        head_dim] float32. Takes only tensors: with graph-safe kernels it runs inside CUDA graphs."""
        return kernels.step_in_pool(xbc, dt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.A_log, self.D,
                                    self.dt_bias, self.dims.time_step_limit, self.groups, pool.conv, pool.ssm, slots)

    def forward(self, x: torch.Tensor, pool: MambaState, slots: torch.Tensor,
                query_start: Sequence[int] | None) -> torch.Tensor:
        """A step over several sequences whose states live in `pool` (leading dim: slots), stepped in place.

        Sequence i has tokens x[query_start[i]:query_start[i + 1]] (any number >= 1: a prompt chunk or one decode
        token) and its state in pool slot slots[i]; query_start None: one token each (a decode step). Invariant:
        slots of one step are distinct; a new sequence's slot is zeroed before its first step.
        """
        return self._mixed(self.in_proj(x), pool, slots, query_start)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm, pool: MambaState,
                       slots: torch.Tensor, query_start: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(s)), s) with s = x + residual (x without one): the norm before the mixer in in_proj's
        launches where its kernel has a norm-fused form (ColumnParallelLinear.forward_normed)."""
        projected, residual = self.in_proj.forward_normed(x, residual, norm)
        return self._mixed(projected, pool, slots, query_start), residual

    def _mixed(self, projected: torch.Tensor, pool: MambaState, slots: torch.Tensor,
               query_start: Sequence[int] | None) -> torch.Tensor:
        """forward after in_proj: `projected` is [z | x | B | C | dt] of every token."""
        kernels = self._kernels(projected.device)
        z, xbc, dt = projected.split([self.inner, self.channels, self.heads], dim=-1)
        if query_start is None:
            h = kernels.step_and_norm_in_pool(xbc, dt, z, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                              self.A_log, self.D, self.dt_bias, self.dims.time_step_limit,
                                              self.groups, self.norm.weight, self.norm.group_size, self.norm.eps,
                                              pool.conv, pool.ssm, slots)
        else:
            y = self._chunks(kernels, xbc, dt, pool, slots, list(query_start))
            h = self.norm(y.reshape(projected.shape[0], self.inner), z, kernels)
        return self.out_proj(h)

    def _chunks(self, kernels: Mamba2Kernels, xbc, dt, pool: MambaState, slots: torch.Tensor,
                starts: list[int]) -> torch.Tensor:
        """y for sequences of any lengths: single tokens step together (one batched call), longer chunks run one
        by one through the chunked scan; every state stepped in its slot."""
        y = torch.empty(xbc.shape[0], self.heads, self.dims.head_dim, dtype=torch.float32, device=xbc.device)
        singles = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
        if singles:
            rows = torch.tensor([starts[i] for i in singles], device=xbc.device)
            y[rows] = self._step(kernels, xbc[rows], dt[rows], pool, slots[torch.tensor(singles, device=xbc.device)])
        steps = step_sizes(dt, self.dt_bias, self.dims.time_step_limit)
        weight, a = self.conv1d.weight.squeeze(1), -torch.exp(self.A_log.float())
        for i in range(len(starts) - 1):
            s, e = starts[i], starts[i + 1]
            if e - s > 1:
                slot = slots[i:i + 1]  # a tensor index: no host sync
                mixed, conv = kernels.conv(xbc[s:e], weight, pool.conv[slot][0], self.conv1d.bias)
                xs, b, c = split_channels(mixed, self.heads, self.dims.head_dim, self.groups)
                y[s:e], ssm = kernels.scan(xs, steps[s:e], a, b, c, self.D, pool.ssm[slot][0], self.dims.chunk_size)
                pool.conv[slot], pool.ssm[slot] = conv.unsqueeze(0), ssm.to(pool.ssm.dtype).unsqueeze(0)
        return y
