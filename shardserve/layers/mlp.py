"""The SwiGLU feed-forward block, down(silu(gate(x)) * up(x)), over one rank's share of its features."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.distributed.communicator import Communicator
from shardserve.layers.linear import ColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, rows: tuple[int, int], bias: bool, dtype: torch.dtype,
                 comm: Communicator | None, replicated: bool) -> None:
        """`rows`: this rank's features (rows of the checkpoint's gate_proj and up_proj, columns of its
        down_proj). With `comm` the output is a partial sum whose all-reduce is left to the next norm
        (`down_proj.pending`); without, it is this rank's whole output (or joins an enclosing block's sum)."""
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, {0: rows, 1: rows}, bias, dtype)
        self.down_proj = RowParallelLinear(rows, hidden_size, bias, dtype, comm)
        self.gate_up_proj.replicated = self.down_proj.replicated = replicated
        # SwiGLU runs in whichever launch can take it: the gate/up product's (its SwiGLU-out forms), else the down
        # projection's (its SwiGLU-input forms), else a kernel of its own between them.
        self.gate_up_proj.makes_swiglu_output = True
        self.down_proj.takes_swiglu_input = True
        self.down_proj.defer()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y, activated = self.gate_up_proj.forward_swiglu(h)
        return self.down_proj(y, swiglu_input=not activated)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, reduce=None,
                       next_norm: nn.Module | None = None):
        """The block on norm(x + residual): (output, new residual, the output's pending reduction), as
        RowParallelLinear.forward_add with `next_norm`; the norm and SwiGLU are fused into the projections where a
        kernel can. `reduce`: x is a partial sum still to be all-reduced (ColumnParallelLinear.forward_normed)."""
        y, residual, activated = self.gate_up_proj.forward_normed_swiglu(x, residual, norm, reduce)
        return self.down_proj.forward_add(y, residual, next_norm, swiglu_input=not activated)
