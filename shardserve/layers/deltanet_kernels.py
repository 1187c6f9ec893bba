"""How a Gated DeltaNet layer's convolution and delta rule run on this hardware, chosen once per device.

One interface, four operations: a prompt chunk of one sequence (`conv`, `rule`) and one token of many sequences
(`conv_step`, `rule_step`). Every operation takes the states as they are and returns the new ones; it writes no
input. Shapes and dtypes are those of kernels/causal_conv1d.py and kernels/gated_delta_rule.py.

- "torch": plain torch ops, the delta rule in float32 chunks of 64 tokens; any device. A GPU form (Triton, or the
  flash-linear-attention kernels) takes its place in `delta_net_kernels` when one is written.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from shardserve.kernels.causal_conv1d import causal_conv1d, causal_conv1d_step
from shardserve.kernels.gated_delta_rule import chunked_gated_delta_rule, gated_delta_rule_step

logger = logging.getLogger(__name__)


class DeltaNetKernels(Protocol):
    name: str

    def conv(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: causal_conv1d.causal_conv1d."""

    def conv_step(self, x: torch.Tensor, weight: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of B sequences: causal_conv1d.causal_conv1d_step."""

    def rule(self, q, k, v, g, beta, scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: gated_delta_rule.chunked_gated_delta_rule."""

    def rule_step(self, q, k, v, g, beta, scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of B sequences: gated_delta_rule.gated_delta_rule_step."""


class TorchDeltaNetKernels:
    name = "torch"

    @staticmethod
    def conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d(x, weight, state)

    @staticmethod
    def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d_step(x, weight, state)

    @staticmethod
    def rule(q, k, v, g, beta, scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_gated_delta_rule(q, k, v, g, beta, scale, state)

    @staticmethod
    def rule_step(q, k, v, g, beta, scale: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gated_delta_rule_step(q, k, v, g, beta, scale, state)


_logged: set[str] = set()


def delta_net_kernels(device: torch.device | str) -> DeltaNetKernels:
    """The kernels Gated DeltaNet layers on `device` use; the choice is logged once per device type."""
    kind = torch.device(device).type
    kernels: DeltaNetKernels = TorchDeltaNetKernels()
    if kind not in _logged:
        _logged.add(kind)
        logger.info("Gated DeltaNet kernels on %s: %s", kind, kernels.name)
    return kernels
