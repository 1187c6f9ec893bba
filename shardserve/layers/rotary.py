"""Rotary position embeddings (rotate-half layout), with Llama-3, linear, YaRN and dynamic-NTK frequency scaling
(transformers' ROPE_INIT_FUNCTIONS; YaRN's attention factor multiplies the cos and sin tables).

Partial rotary (Qwen3-Next): the tables are as wide as the rotated dims, the first of each head; the rest pass
through unchanged."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardserve.kernels.availability import use_triton


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The rotation's frequencies; `scaling` as ModelConfig.rope_scaling gives it (original_max_position_embeddings
    filled in for YaRN and dynamic NTK)."""
    kind = scaling["rope_type"] if scaling is not None else "default"
    if kind == "dynamic":
        theta = _dynamic_ntk_theta(theta, head_dim, scaling)
    if kind == "yarn":
        return _yarn_scaled(head_dim, theta, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What the cos and sin tables are multiplied by: YaRN's attention scaling (its `attention_factor`, else
    0.1 ln(factor) + 1, or the ratio of the mscale and mscale_all_dim terms where both are given); 1 otherwise."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (DeepSeek's attention scale squares it)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaled(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies of fewer than beta_slow turns over the original context divided by `factor`
    (interpolated), those of more than beta_fast kept (extrapolated), a linear ramp between."""
    factor, original = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(turns: float) -> float:  # the dim whose frequency turns `turns` times over the context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def _dynamic_ntk_theta(theta: float, dim: int, s: dict[str, Any]) -> float:
    """Dynamic NTK's base for the longest context the scaling allows (original x factor), fixed for every length
    as vLLM does: transformers instead recomputes it from the longest sequence it has seen so far, so the two agree
    only at that length."""
    factor, original = s["factor"], s["original_max_position_embeddings"]
    longest = original * factor
    return theta * ((factor * longest / original) - (factor - 1)) ** (dim / (dim - 2))


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
        mscale = attention_factor(scaling)
        sin = emb.sin() * mscale
        self.register_buffer("cos", (emb.cos() * mscale).to(dtype), persistent=False)
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
