"""Rotary position embeddings (rotate-half layout), with Llama-3 and linear frequency scaling.

Partial rotary (Qwen3-Next): the tables are as wide as the rotated dims, the first of each head; the rest pass
through unchanged."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardserve.kernels.availability import use_triton


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        sin = emb.sin()
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        # The rotate-half sign lives in the table: x * cos + roll(x, half) * signed_sin.
        self.register_buffer("signed_sin", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype),
                             persistent=False)

    def lookup(self, positions: torch.Tensor) -> "RotaryLookup":
        """The rotation for a step's positions; looked up once, applied by every layer."""
        if use_triton(positions):
            return RotaryLookup(positions=positions, cos=self.cos, signed_sin=self.signed_sin)
        return RotaryLookup(cos=self.cos[positions].unsqueeze(1), signed_sin=self.signed_sin[positions].unsqueeze(1))


class RotaryLookup:
    """Either gathered tables [tokens, 1, head_dim] (torch path) or positions plus whole tables (Triton)."""

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        self.cos, self.signed_sin, self.positions = cos, signed_sin, positions

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [tokens, heads, head_dim] (query and key heads may be stacked along heads).

        Equals x * cos + rotate_half(x) * sin bit for bit: rotate_half(x) * sin is roll(x) * signed_sin.
        The Triton kernel rotates x in place and returns it. Tables narrower than head_dim rotate its first
        dims only (in place too, on a strided view of them, with the Triton kernel).
        """
        rotary_dim = self.cos.shape[-1]
        if rotary_dim < x.shape[-1] and self.positions is not None:  # in place on a view of the rotated dims
            self._rotate(x[..., :rotary_dim])
            return x
        if rotary_dim < x.shape[-1]:
            rotated = self._rotate(x[..., :rotary_dim].contiguous())
            return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
        return self._rotate(x)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.positions is not None:
            from shardserve.kernels.triton.fused_ops import apply_rotary_

            return apply_rotary_(x, self.positions, self.cos, self.signed_sin)
        return x * self.cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * self.signed_sin
