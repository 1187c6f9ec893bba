"""Decides how each block of a decoder layer is split across tensor-parallel ranks.

A block is sharded only when every rank gets an equal, kernel-friendly slice; otherwise it is
replicated (each rank computes it whole, no collective), which costs memory but never correctness.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shardserve import envs

logger = logging.getLogger(__name__)


def min_shard_width() -> int:
    """Narrowest per-rank output width the matmul kernels take; a narrower shard is replicated instead."""
    return envs.MIN_SHARD_WIDTH.get()


@dataclass(frozen=True)
class AttentionShard:
    """Which query and KV heads one rank owns.

    Invariant: every local query head's KV head is local too; `kv_index[i]` is the local KV head
    that local query head i attends with. KV heads are replicated across ranks when there are
    fewer of them than ranks (or when the split puts one group on two ranks).
    """

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    kv_index: tuple[int, ...]
    sharded: bool

    @property
    def num_q(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def attention_shard(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, tp: int,
                    layer_name: str = "attention") -> AttentionShard:
    group = num_heads // num_kv_heads
    sharded = tp > 1 and num_heads % tp == 0 and (num_heads // tp) * head_dim >= min_shard_width()
    if tp > 1 and not sharded:
        _log_replicated(layer_name, f"{num_heads} query heads of width {head_dim} do not split into {tp} "
                                    f"slices of at least {min_shard_width()}")
    if not sharded:
        rank, tp = 0, 1
    per_rank = num_heads // tp
    q0, q1 = rank * per_rank, (rank + 1) * per_rank
    kv0, kv1 = q0 // group, (q1 - 1) // group + 1
    kv_index = tuple(q // group - kv0 for q in range(q0, q1))
    return AttentionShard((q0, q1), (kv0, kv1), kv_index, sharded)


def split_rows(size: int, rank: int, tp: int, layer_name: str) -> tuple[tuple[int, int], bool]:
    """Rows [start, end) of a dimension of `size` owned by `rank`, or the whole range if not splittable."""
    if tp > 1 and size % tp == 0 and size // tp >= min_shard_width():
        per_rank = size // tp
        return (rank * per_rank, (rank + 1) * per_rank), True
    if tp > 1:
        _log_replicated(layer_name, f"width {size} does not split into {tp} slices of at least {min_shard_width()}")
    return (0, size), False


@dataclass(frozen=True)
class ExpertShard:
    """Which experts of a mixture-of-experts block, and which intermediate features of each, one rank holds.

    Either every expert with the features `rows` of each (split by features, as a dense MLP is), or under expert
    parallelism whole experts [e0, e1) (rows all of them). `sharded`: each rank computes a share of the block's
    output, which the layer's all-reduce sums; False: every rank holds every expert whole and computes the whole
    output (the features did not split evenly), no collective.
    """

    experts: tuple[int, int]
    rows: tuple[int, int]
    sharded: bool


def expert_shard(num_experts: int, intermediate_size: int, rank: int, tp: int, expert_parallel: bool,
                 layer_name: str = "moe experts") -> ExpertShard:
    """This rank's experts and features: whole experts, num_experts / tp of them, with `expert_parallel` where they
    divide among the ranks (logged where they do not: then split by features); else every expert split by
    features where split_rows splits them, else every expert whole on every rank (logged)."""
    if expert_parallel and tp > 1 and num_experts % tp == 0:
        # Expert parallelism: whole experts, E / ranks each; every rank routes all tokens and computes its experts'
        # share, and the layer's all-reduce sums the shares (masking, no all-to-all).
        per_rank = num_experts // tp
        return ExpertShard((rank * per_rank, (rank + 1) * per_rank), (0, intermediate_size), True)
    if expert_parallel and tp > 1:
        logger.info("%d experts do not divide among %d ranks: each expert is split by features instead",
                    num_experts, tp)
    rows, sharded = split_rows(intermediate_size, rank, tp, layer_name)
    return ExpertShard((0, num_experts), rows, sharded)


@dataclass(frozen=True)
class DeltaNetShard:
    """Which key heads and value heads of a Gated DeltaNet layer one rank owns.

    Value head v belongs to key head v // (value_heads // key_heads); a rank owns whole groups: the key heads
    [k0, k1) and exactly their value heads [v0, v1), so the convolution channels, the recurrent state and the
    output projection's columns of a local value head are all local too. Replicated (the whole layer on every
    rank) when the key heads do not split into equal, wide enough parts.
    """

    key_heads: tuple[int, int]
    value_heads: tuple[int, int]
    sharded: bool

    @property
    def num_key(self) -> int:
        return self.key_heads[1] - self.key_heads[0]

    @property
    def num_value(self) -> int:
        return self.value_heads[1] - self.value_heads[0]


def delta_net_shard(key_heads: int, value_heads: int, key_dim: int, value_dim: int, rank: int, tp: int,
                    layer_name: str = "linear attention") -> DeltaNetShard:
    """This rank's heads of a Gated DeltaNet layer with `key_heads` heads of width `key_dim` (queries and keys)
    and `value_heads` of width `value_dim`."""
    if value_heads % key_heads:
        raise ValueError(f"{layer_name}: {value_heads} value heads do not group evenly over {key_heads} key heads")
    group = value_heads // key_heads
    per_rank = key_heads // tp
    narrowest = min(per_rank * key_dim, per_rank * group * value_dim)  # a rank's q (or k) width, or its v width
    sharded = tp > 1 and key_heads % tp == 0 and narrowest >= min_shard_width()
    if tp > 1 and not sharded:
        _log_replicated(layer_name, f"{key_heads} key heads of width {key_dim} do not split into {tp} slices "
                                    f"of at least {min_shard_width()}")
    if not sharded:
        rank, per_rank = 0, key_heads
    k0, k1 = rank * per_rank, (rank + 1) * per_rank
    return DeltaNetShard((k0, k1), (k0 * group, k1 * group), sharded)


@dataclass(frozen=True)
class MambaShard:
    """Which heads of a Mamba-2 layer, and which of its B/C groups, one rank owns.

    Consecutive heads share a group (heads // groups each), and the gated norm normalises over a group's heads
    together, so a rank owns whole groups: the groups [g0, g1) and exactly their heads [h0, h1). Its convolution
    channels (its heads' x, its groups' B and C), its SSM state and its out_proj columns follow. Replicated (the
    whole layer on every rank) unless the groups split evenly: a group is never sliced.
    """

    heads: tuple[int, int]
    groups: tuple[int, int]
    sharded: bool

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_groups(self) -> int:
        return self.groups[1] - self.groups[0]


def mamba_shard(heads: int, groups: int, head_dim: int, rank: int, tp: int, layer_name: str = "mamba") -> MambaShard:
    """This rank's heads and groups of a Mamba-2 layer with `heads` heads of width `head_dim` in `groups` groups."""
    if heads % groups:
        raise ValueError(f"{layer_name}: {heads} heads do not group evenly over {groups} groups (n_groups)")
    per_group = heads // groups
    sharded = tp > 1 and groups % tp == 0 and (heads // tp) * head_dim >= min_shard_width()
    if tp > 1 and not sharded:
        _log_replicated(layer_name, f"its {groups} B/C groups (n_groups) of {per_group} heads of width {head_dim} "
                                    f"do not split into {tp} parts of whole groups at least {min_shard_width()} wide")
    if not sharded:
        rank, tp = 0, 1
    per_rank = groups // tp
    g0, g1 = rank * per_rank, (rank + 1) * per_rank
    return MambaShard((g0 * per_group, g1 * per_group), (g0, g1), sharded)


_logged: set[str] = set()


def _log_replicated(layer_name: str, reason: str) -> None:
    # One line per distinct decision, not one per layer.
    key = f"{layer_name}:{reason}"
    if key not in _logged:
        _logged.add(key)
        logger.warning("replicating %s on every rank instead of sharding it: %s", layer_name, reason)
