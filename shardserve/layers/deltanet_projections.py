"""The parameters of a Gated DeltaNet layer that hold one rank's heads, and how they read checkpoint tensors.

Two checkpoint layouts carry the same weights:
- Qwen3-Next: `in_proj_qkvz` interleaved per key-head group, [q | k | v | z] of group 0, then of group 1, ...
  (q, k: key_dim rows each; v, z: group * value_dim rows each), and `in_proj_ba`, [b | a] per group
  (group rows each).
- Qwen3.5: `in_proj_qkv` as [q of every head | k of every head | v of every head], `in_proj_z`, `in_proj_b`,
  `in_proj_a`, each head-major.

Whichever a checkpoint uses, the local weights are laid out one way: in_proj_qkvz's rows are [q | k | v | z] of
this rank's heads, in_proj_ba's [b | a], conv1d's channels [q | k | v] (the convolution's input, in the order of
the first three parts of in_proj_qkvz). Since a rank owns whole key-head groups (layers/sharding.DeltaNetShard),
each of its parts is one range of checkpoint rows, and the interleaved layout is one range too: every rank reads
only its rows.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import nn

from shardserve.layers.linear import ColumnParallelLinear, as_tensor, copy_exact, empty_parameter
from shardserve.layers.sharding import DeltaNetShard

Rows = tuple[int, int]


def qkv_rows(key_heads: int, key_dim: int, value_dim: int, shard: DeltaNetShard) -> dict[str, Rows]:
    """Rows of q, k and v of this rank's heads in a head-major [q | k | v] tensor (Qwen3.5's in_proj_qkv, and
    the convolution's channels in both layouts)."""
    (k0, k1), (v0, v1) = shard.key_heads, shard.value_heads
    keys = key_heads * key_dim
    return {"q": (k0 * key_dim, k1 * key_dim), "k": (keys + k0 * key_dim, keys + k1 * key_dim),
            "v": (2 * keys + v0 * value_dim, 2 * keys + v1 * value_dim)}


def load_interleaved(layer: ColumnParallelLinear, param: nn.Parameter, loaded: Any, shard: DeltaNetShard,
                     parts: tuple[str, ...], widths: list[int]) -> None:
    """Read this rank's key-head groups of a tensor interleaved per group as `parts` of `widths` rows each, and
    place each part's rows, group after group, at its offset in `layer`: a range of checkpoint rows per group and
    part, so a packed layer (FP8, 4-bit) reads each range in its stored form, or quantizes it, as a part of a
    fused layer (rows stay whole, so per-row scales and groups along the input are untouched)."""
    k0, k1 = shard.key_heads
    per_group = sum(widths)
    within = 0
    for part, width in zip(parts, widths):
        offset, _ = layer.offsets[part]
        for j, group in enumerate(range(k0, k1)):
            src, dst = group * per_group + within, offset + j * width
            if layer.packed is not None:
                layer.packed.load(layer, loaded, slice(dst, dst + width), (src, src + width), None, part)
            else:
                copy_exact(param.data[dst:dst + width], as_tensor(loaded[src:src + width]))
        within += width


class InProjQKVZ(ColumnParallelLinear):
    """Local rows [q | k | v | z]. Shard ids: None for Qwen3-Next's interleaved in_proj_qkvz, "qkv" and "z" for
    Qwen3.5's in_proj_qkv and in_proj_z."""

    def __init__(self, hidden_size: int, key_heads: int, key_dim: int, value_dim: int, shard: DeltaNetShard,
                 dtype: torch.dtype) -> None:
        (v0, v1) = shard.value_heads
        parts = {**qkv_rows(key_heads, key_dim, value_dim, shard), "z": (v0 * value_dim, v1 * value_dim)}
        super().__init__(hidden_size, parts, False, dtype)
        self.key_dim, self.value_dim, self.shard = key_dim, value_dim, shard

    def _load_rows(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        if shard_id == "qkv":
            for part in ("q", "k", "v"):
                super()._load_rows(param, loaded, part)
        elif shard_id is None:
            group = self.shard.num_value // self.shard.num_key
            widths = [self.key_dim, self.key_dim, group * self.value_dim, group * self.value_dim]
            load_interleaved(self, param, loaded, self.shard, ("q", "k", "v", "z"), widths)
        else:
            super()._load_rows(param, loaded, shard_id)


class InProjBA(ColumnParallelLinear):
    """Local rows [b | a], one each per local value head. Shard ids: None for Qwen3-Next's interleaved
    in_proj_ba, "b" and "a" for Qwen3.5's in_proj_b and in_proj_a."""

    def __init__(self, hidden_size: int, shard: DeltaNetShard, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, {"b": shard.value_heads, "a": shard.value_heads}, False, dtype)
        self.shard = shard

    def _load_rows(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        if shard_id is None:
            group = self.shard.num_value // self.shard.num_key
            load_interleaved(self, param, loaded, self.shard, ("b", "a"), [group, group])
        else:
            super()._load_rows(param, loaded, shard_id)


class ConvWeight(nn.Module):
    """The depthwise convolution's taps of this rank's channels: `weight` [channels, 1, K], checkpoint
    `conv1d.weight` rows q, k, v (qkv_rows) stacked."""

    def __init__(self, rows: dict[str, Rows], kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows = list(rows.values())
        self.weight = empty_parameter(sum(e - s for s, e in self.rows), 1, kernel, dtype=dtype)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        offset = 0
        for start, end in self.rows:
            copy_exact(param.data[offset:offset + end - start], loaded[start:end])
            offset += end - start


def head_vector(heads: Rows, dtype: torch.dtype) -> nn.Parameter:
    """A per-value-head parameter (A_log, dt_bias) holding the entries of this rank's value heads `heads`."""
    param = empty_parameter(heads[1] - heads[0], dtype=dtype)

    def load(p: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        copy_exact(p.data, loaded[heads[0]:heads[1]])

    param.weight_loader = load
    return param
