"""How a Gated DeltaNet layer's heads are split over tensor-parallel ranks (layers/sharding.py)."""

from __future__ import annotations

import pytest

from shardserve.layers.sharding import delta_net_shard


def test_each_rank_owns_whole_key_head_groups():
    """Qwen3-Next's 16 key heads and 32 value heads over 4 ranks: 4 key heads and their 8 value heads each."""
    shards = [delta_net_shard(16, 32, 128, 128, rank, 4) for rank in range(4)]
    assert [s.key_heads for s in shards] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert [s.value_heads for s in shards] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert all(s.sharded for s in shards)


@pytest.mark.parametrize("key_heads,key_dim,tp", [(3, 128, 2), (2, 128, 4), (4, 4, 2)])
def test_heads_that_do_not_split_are_replicated(key_heads, key_dim, tp):
    """Key heads that do not divide by the ranks, or slices narrower than the kernels take: every rank holds
    the whole layer."""
    for rank in range(tp):
        shard = delta_net_shard(key_heads, 2 * key_heads, key_dim, 128, rank, tp)
        assert not shard.sharded
        assert shard.key_heads == (0, key_heads) and shard.value_heads == (0, 2 * key_heads)


def test_value_heads_must_group_over_key_heads():
    with pytest.raises(ValueError, match="7 value heads do not group evenly over 2 key heads"):
        delta_net_shard(2, 7, 128, 128, 0, 1)
