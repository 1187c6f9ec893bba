"""What the token mixers that keep a per-sequence state (Gated DeltaNet, Mamba-2) share.

Each such layer steps sequences whose states live in pool slots: forward(x, pool, slots, query_start), the pool
a NamedTuple of tensors with a leading slot dim (query_start None: one token a sequence). `prefill` and `decode`
run the same forward over states held outside the engine's pools (one sequence, or a batch of them), leaving the
given states unwritten.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class StateMixer(nn.Module):
    def zero_state(self, batch: int | None = None, device: torch.device | str | None = None) -> NamedTuple:
        """The state of `batch` sequences (one without a batch dim when None) that have no tokens yet."""
        raise NotImplementedError

    def prefill(self, x: torch.Tensor, state: NamedTuple | None = None) -> tuple[torch.Tensor, NamedTuple]:
        """One sequence's next T >= 1 tokens x [T, hidden] from `state` (None: a new sequence).
        Returns (output [T, hidden], the state after them); `state` is not written."""
        state = self.zero_state(device=x.device) if state is None else state
        pool = type(state)(*(t.unsqueeze(0).clone() for t in state))
        out = self(x, pool, torch.zeros(1, dtype=torch.long, device=x.device), [0, x.shape[0]])
        return out, type(state)(*(t[0] for t in pool))

    def decode(self, x: torch.Tensor, states: NamedTuple) -> tuple[torch.Tensor, NamedTuple]:
        """One token for each of B sequences at once: x [B, hidden], states with leading dim [B].
        Returns (output [B, hidden], their states after the token); `states` is not written."""
        pool = type(states)(*(t.clone() for t in states))
        out = self(x, pool, torch.arange(x.shape[0], device=x.device), None)
        return out, pool
