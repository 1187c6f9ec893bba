"""How a Gated DeltaNet layer's convolution and delta rule run on this hardware, chosen once per device.

One interface, four operations: a prompt chunk of one sequence (`conv`, `rule`: they take the states as they are
and return the new ones, writing no input; shapes and dtypes those of kernels/causal_conv1d.py and
kernels/gated_delta_rule.py), and a decode step (`step_in_pool`: one token of each of B sequences, from the
input projections' outputs to the delta rule's output, stepping the sequences' states where they live in the
layer's pools; `step_and_norm_in_pool`: the same through the layer's gated output norm, to the rows out_proj
takes). A decode step takes only tensors, so it runs inside CUDA graphs.

- "torch": plain torch ops, the delta rule in float32 chunks of 64 tokens; any device. Its decode step indexes the
  pools by slot, so a CUDA graph's padding row (slot -1) would step the last slot: not graph-safe, decode eager.
- "triton decode": on CUDA GPUs with Triton, the decode step in two kernels that step the states in place
  (kernels/triton/causal_conv1d.py, kernels/triton/gated_delta_rule.py), then the norm in a third
  (kernels/triton/gated_rms_norm.py); prompt chunks as "torch".
- "triton fused decode": the same, with the decode step and its norm in one kernel
  (kernels/triton/deltanet_decode.py): a launch a layer instead of three.
- "triton fused decode, fla-core prefill": the same, with 16-bit models' prompt chunks through the
  flash-linear-attention package's Triton chunk_gated_delta_rule where `fla-core` is installed: on an H200 it
  prefills a 32k-token prompt's layer of Qwen3-Next-80B-A3B (32 value heads of 128 x 128) in 2.1 ms against 75 ms
  for the torch form (benchmarks/delta_rule_prefill.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch

from shardserve.kernels import availability
from shardserve.kernels.causal_conv1d import causal_conv1d, causal_conv1d_step
from shardserve.kernels.gated_delta_rule import (chunked_gated_delta_rule, delta_rule_gates,
                                                 gated_delta_rule_step, split_heads)
from shardserve.layers.norm import gated_rms_norm_rows

logger = logging.getLogger(__name__)


class DeltaNetKernels(Protocol):
    name: str
    graph_safe: bool  # whether the decode steps leave every slot alone for a row of slot -1 (a graph's padding row)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: causal_conv1d.causal_conv1d."""

    def rule(self, q, k, v, g, beta, scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: gated_delta_rule.chunked_gated_delta_rule."""

    def step_in_pool(self, qkv: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, scale: float, key_heads: int, conv_pool: torch.Tensor,
                     rec_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences: qkv [B, channels] ([q | k | v] before the convolution), ba [B, 2 *
        value_heads] ([b | a]); conv_weight [channels, K]; a_log, dt_bias float32 [value_heads]; the pools
        [slots, ...] as DeltaNetState lays them out; slots int64 [B], distinct. Steps rows' states in their
        slots, in place, and returns the delta rule's output o float32 [B, value_heads, value_dim]."""

    def step_and_norm_in_pool(self, qkv: torch.Tensor, ba: torch.Tensor, z: torch.Tensor, conv_weight: torch.Tensor,
                              a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              scale: float, key_heads: int, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
                              slots: torch.Tensor) -> torch.Tensor:
        """step_in_pool, then the layer's gated norm of its output (layers/norm.gated_rms_norm_rows) with z [B,
        value_heads * value_dim] (rows may be strided), norm_weight [value_dim] in the model's dtype and eps:
        the rows out_proj takes, [B, value_heads * value_dim] in norm_weight's dtype."""


class TorchDeltaNetKernels:
    name = "torch"
    graph_safe = False  # pool[slots] with slot -1 would step the last slot, which a live sequence may hold

    @staticmethod
    def conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d(x, weight, state)

    @staticmethod
    def rule(q, k, v, g, beta, scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_gated_delta_rule(q, k, v, g, beta, scale, state)

    @staticmethod
    def step_in_pool(qkv, ba, conv_weight, a_log, dt_bias, scale: float, key_heads: int, conv_pool, rec_pool,
                     slots) -> torch.Tensor:
        value_heads, key_dim, value_dim = rec_pool.shape[1:]
        mixed, conv_pool[slots] = causal_conv1d_step(qkv, conv_weight, conv_pool[slots])
        q, k, v = split_heads(mixed, key_heads, key_dim, value_heads, value_dim)
        g, beta = delta_rule_gates(ba, a_log, dt_bias)
        o, rec_pool[slots] = gated_delta_rule_step(q, k, v, g, beta, scale, rec_pool[slots])
        return o

    @classmethod
    def step_and_norm_in_pool(cls, qkv, ba, z, conv_weight, a_log, dt_bias, norm_weight, eps: float, scale: float,
                              key_heads: int, conv_pool, rec_pool, slots) -> torch.Tensor:
        o = cls.step_in_pool(qkv, ba, conv_weight, a_log, dt_bias, scale, key_heads, conv_pool, rec_pool, slots)
        return gated_rms_norm_rows(o, z, norm_weight, eps)


class TritonDecodeDeltaNetKernels(TorchDeltaNetKernels):
    name = "triton decode"
    graph_safe = True

    @staticmethod
    def step_in_pool(qkv, ba, conv_weight, a_log, dt_bias, scale: float, key_heads: int, conv_pool, rec_pool,
                     slots) -> torch.Tensor:
        from shardserve.kernels.triton.causal_conv1d import conv_step_in_pool
        from shardserve.kernels.triton.gated_delta_rule import rule_step_in_pool

        mixed = conv_step_in_pool(qkv, conv_weight, conv_pool, slots)
        return rule_step_in_pool(mixed, ba, a_log, dt_bias, scale, rec_pool, slots, key_heads)


class TritonFusedDecodeDeltaNetKernels(TritonDecodeDeltaNetKernels):
    name = "triton fused decode"

    @classmethod
    def step_and_norm_in_pool(cls, qkv, ba, z, conv_weight, a_log, dt_bias, norm_weight, eps: float, scale: float,
                              key_heads: int, conv_pool, rec_pool, slots) -> torch.Tensor:
        from shardserve.kernels.triton.deltanet_decode import step_and_norm_in_pool

        args = (qkv, ba, z, conv_weight, a_log, dt_bias, norm_weight, eps, scale, key_heads, conv_pool, rec_pool,
                slots)
        out = step_and_norm_in_pool(*args)
        return super().step_and_norm_in_pool(*args) if out is None else out  # None: no arrival counts here


class FlaPrefillDeltaNetKernels(TritonFusedDecodeDeltaNetKernels):
    name = "triton fused decode, fla-core prefill"

    @staticmethod
    def rule(q, k, v, g, beta, scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if v.dtype == torch.float32:  # its products of float32 inputs round to TF32: float32 models keep torch's
            return TorchDeltaNetKernels.rule(q, k, v, g, beta, scale, state)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        group = v.shape[1] // q.shape[1]
        q, k = (x.repeat_interleave(group, dim=1).to(v.dtype)[None] for x in (q, k))
        o, final = chunk_gated_delta_rule(q, k, v[None], g[None], beta[None], scale=scale,
                                          initial_state=state[None].float(), output_final_state=True)
        return o[0].float(), final[0]


@functools.cache
def _fla_importable() -> bool:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or not for this torch / Triton
        return False
    return True


_chosen: dict[str, DeltaNetKernels] = {}


def delta_net_kernels(device: torch.device | str) -> DeltaNetKernels:
    """The kernels Gated DeltaNet layers on `device` use, chosen (and logged) once per device type."""
    kind = torch.device(device).type
    if kind not in _chosen:
        kernels: DeltaNetKernels = TorchDeltaNetKernels()
        if kind == "cuda" and availability.triton_usable():
            kernels = FlaPrefillDeltaNetKernels() if _fla_importable() else TritonFusedDecodeDeltaNetKernels()
        _chosen[kind] = kernels
        logger.info("Gated DeltaNet kernels on %s: %s", kind, kernels.name)
    return _chosen[kind]
