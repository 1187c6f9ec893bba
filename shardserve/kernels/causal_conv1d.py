"""The short causal depthwise convolution of a Gated DeltaNet or Mamba-2 layer, followed by SiLU, in plain torch.

Each channel c is convolved with its own kernel w[c] of K taps over time: y_t = silu(sum_i w[c, i] x_{t-K+1+i}
(+ bias[c] where the layer has one, as Mamba-2's may)).
The state of a sequence is its last K - 1 inputs per channel, [channels, K - 1], oldest first (zeros before the
first token), so a prompt split into chunks gives the same outputs as the whole prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of T >= 1 tokens: x [T, channels], weight [channels, K], state [channels, K - 1].
    Returns (y [T, channels] in x's dtype, the state after the last token); `state` is not written."""
    channels = x.shape[1]
    window = torch.cat((state.to(x.dtype), x.transpose(0, 1)), dim=1)  # [channels, K - 1 + T]
    y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), None if bias is None else bias.to(x.dtype),
                 groups=channels)[0]
    return F.silu(y).transpose(0, 1), window[:, window.shape[1] - state.shape[1]:]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: x [B, channels], weight [channels, K], state [B, channels, K - 1].
    Returns (y [B, channels], the states after the token); `state` is not written."""
    window = torch.cat((state.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # [B, channels, K]
    # Summed in float32 and rounded once, as conv1d does in the prefill form: a token gets the same value either way.
    y = (window.float() * weight.float()).sum(-1)
    y = (y if bias is None else y + bias.float()).to(x.dtype)
    return F.silu(y), window[..., 1:]
