"""How a Mamba-2 layer's convolution and SSM run on this hardware, chosen once per device.

One interface, five operations: a prompt chunk of one sequence (`conv`, `scan`: they take the states as they are
and return the new ones, writing no input; shapes and dtypes those of kernels/causal_conv1d.py and
kernels/mamba2_ssd.py), a decode step (`step_in_pool`: one token of each of B sequences, from the input
projection's outputs to the SSM's output, stepping the sequences' states where they live in the layer's pools;
`step_and_norm_in_pool`: the same through the gated output norm, to the rows out_proj takes), and the gated output
norm of any rows (`norm`).

- "torch": plain torch ops, the SSM in float32 chunks (kernels/mamba2_ssd.py); any device. Its decode step
  gathers and scatters states by slot, so a row with slot -1 (a CUDA graph's padding row) would step the pool's
  last slot: graph_safe is False and such layers decode eagerly.
- "triton decode": on CUDA GPUs with Triton, the decode step in two kernels that step the states in place and
  skip slot -1 (kernels/triton/causal_conv1d.py, kernels/triton/mamba2_step.py), so it runs inside CUDA graphs,
  and the norm in one (kernels/triton/gated_rms_norm.py); prompt chunks as "torch".
- "triton fused decode": the same, with a decode step of at most FUSED_MAX_ROWS rows and its norm in one kernel
  (kernels/triton/mamba2_decode.py): a launch a layer instead of three. Chosen on CUDA GPUs with Triton.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from shardserve.kernels import availability
from shardserve.kernels.causal_conv1d import causal_conv1d, causal_conv1d_step
from shardserve.kernels.mamba2_ssd import split_channels, ssd_chunked, ssd_step, step_sizes

logger = logging.getLogger(__name__)


class Mamba2Kernels(Protocol):
    name: str
    graph_safe: bool  # whether step_in_pool takes only tensors and leaves every slot alone for a row of slot -1

    def conv(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
             bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: causal_conv1d.causal_conv1d."""

    def scan(self, x, dt, a, b, c, d, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: mamba2_ssd.ssd_chunked."""

    def step_in_pool(self, xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                     conv_bias: torch.Tensor | None, a_log: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor,
                     time_step_limit: tuple[float, float], groups: int, conv_pool: torch.Tensor,
                     ssm_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences: xbc [B, channels] ([x | B | C] before the convolution), dt [B, heads]
        (before softplus); conv_weight [channels, K], conv_bias [channels] or None; a_log, d, dt_bias float32
        [heads]; the pools [slots, ...] as MambaState lays them out; slots int64 [B], distinct. Steps rows' states
        in their slots, in place, and returns the SSM's output y float32 [B, heads, head_dim]."""

    def norm(self, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
             eps: float) -> torch.Tensor:
        """weight * norm(y * silu(z)), the RMS over each group of group_size features apart: y [rows, features]
        float32, z [rows, features] (rows may be strided), weight [features]. Returns [rows, features] in weight's
        dtype, normalised in float32 and rounded before the weight (NemotronH's RMSNormGated)."""

    def step_and_norm_in_pool(self, xbc: torch.Tensor, dt: torch.Tensor, z: torch.Tensor,
                              conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, a_log: torch.Tensor,
                              d: torch.Tensor, dt_bias: torch.Tensor, time_step_limit: tuple[float, float],
                              groups: int, norm_weight: torch.Tensor, group_size: int, eps: float,
                              conv_pool: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """step_in_pool, then `norm` of its output with z [B, heads * head_dim] (rows may be strided), norm_weight,
        group_size and eps: the rows out_proj takes, [B, heads * head_dim] in norm_weight's dtype."""


class TorchMamba2Kernels:
    name = "torch"
    graph_safe = False

    @staticmethod
    def conv(x, weight, state, bias) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d(x, weight, state, bias)

    @staticmethod
    def scan(x, dt, a, b, c, d, state, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ssd_chunked(x, dt, a, b, c, d, state, chunk_size)

    @staticmethod
    def step_in_pool(xbc, dt, conv_weight, conv_bias, a_log, d, dt_bias, time_step_limit, groups: int, conv_pool,
                     ssm_pool, slots) -> torch.Tensor:
        heads, head_dim = ssm_pool.shape[1:3]
        mixed, conv_pool[slots] = causal_conv1d_step(xbc, conv_weight, conv_pool[slots], conv_bias)
        xs, b, c = split_channels(mixed, heads, head_dim, groups)
        y, ssm = ssd_step(xs, step_sizes(dt, dt_bias, time_step_limit), -torch.exp(a_log.float()), b, c, d,
                          ssm_pool[slots])
        ssm_pool[slots] = ssm.to(ssm_pool.dtype)
        return y

    @staticmethod
    def norm(y, z, weight, group_size: int, eps: float) -> torch.Tensor:
        h = y.float() * torch.nn.functional.silu(z.float())
        g = h.view(*h.shape[:-1], -1, group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
        return weight * g.view(h.shape).to(weight.dtype)

    @classmethod
    def step_and_norm_in_pool(cls, xbc, dt, z, conv_weight, conv_bias, a_log, d, dt_bias, time_step_limit,
                              groups: int, norm_weight, group_size: int, eps: float, conv_pool, ssm_pool,
                              slots) -> torch.Tensor:
        y = cls.step_in_pool(xbc, dt, conv_weight, conv_bias, a_log, d, dt_bias, time_step_limit, groups, conv_pool,
                             ssm_pool, slots)
        return cls.norm(y.reshape(xbc.shape[0], -1), z, norm_weight, group_size, eps)


class TritonDecodeMamba2Kernels(TorchMamba2Kernels):
    name = "triton decode"
    graph_safe = True

    @staticmethod
    def step_in_pool(xbc, dt, conv_weight, conv_bias, a_log, d, dt_bias, time_step_limit, groups: int, conv_pool,
                     ssm_pool, slots) -> torch.Tensor:
        from shardserve.kernels.triton.causal_conv1d import conv_step_in_pool
        from shardserve.kernels.triton.mamba2_step import ssm_step_in_pool

        mixed = conv_step_in_pool(xbc, conv_weight, conv_pool, slots, conv_bias)
        return ssm_step_in_pool(mixed, dt, a_log, d, dt_bias, time_step_limit, groups, ssm_pool, slots)

    @staticmethod
    def norm(y, z, weight, group_size: int, eps: float) -> torch.Tensor:
        from shardserve.kernels.triton.gated_rms_norm import grouped_gated_rms_norm

        return grouped_gated_rms_norm(y, z, weight, group_size, eps)


# Rows up to which a decode step takes the one kernel: on an H200 at Nemotron-3-Nano's sizes (benchmarks/
# mamba2_decode.py, us a layer, one kernel against three) 6.5 / 8.7 at one row, 8.0 / 9.8 at two, 8.6 / 11.9 at
# three, a tie at four (12.4 / 12.8, and 12.4 / 11.7 in another run), 18.4 / 17.3 at eight: past a few rows every
# program's own B/C convolution and the group's norm after its slowest program cost more than two launches.
FUSED_MAX_ROWS = 3


class TritonFusedDecodeMamba2Kernels(TritonDecodeMamba2Kernels):
    name = "triton fused decode"

    @classmethod
    def step_and_norm_in_pool(cls, xbc, dt, z, conv_weight, conv_bias, a_log, d, dt_bias, time_step_limit,
                              groups: int, norm_weight, group_size: int, eps: float, conv_pool, ssm_pool,
                              slots) -> torch.Tensor:
        from shardserve.kernels.triton.mamba2_decode import step_and_norm_in_pool

        args = (xbc, dt, z, conv_weight, conv_bias, a_log, d, dt_bias, time_step_limit, groups, norm_weight,
                group_size, eps, conv_pool, ssm_pool, slots)
        if xbc.shape[0] > FUSED_MAX_ROWS:
            return super().step_and_norm_in_pool(*args)
        out = step_and_norm_in_pool(*args)
        # None: the norm's groups are not the B/C groups, or no arrival counts here
        return super().step_and_norm_in_pool(*args) if out is None else out


_chosen: dict[str, Mamba2Kernels] = {}


def mamba2_kernels(device: torch.device | str) -> Mamba2Kernels:
    """The kernels Mamba-2 layers on `device` use, chosen (and logged) once per device type."""
    kind = torch.device(device).type
    if kind not in _chosen:
        kernels: Mamba2Kernels = TorchMamba2Kernels()
        if kind == "cuda" and availability.triton_usable():
            kernels = TritonFusedDecodeMamba2Kernels()
        _chosen[kind] = kernels
        logger.info("Mamba-2 kernels on %s: %s", kind, kernels.name)
    return _chosen[kind]
