"""KV-cache block accounting and prefix caching, on the real BlockManager."""

from __future__ import annotations

import pytest

from shardserve.engine.block_manager import BlockManager, chain_hash
from shardserve.engine.sequence import Sequence
from shardserve.requests.sampling_params import SamplingParams

BS = 4  # block size


def _seq(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, tokens, SamplingParams())


def _block(first: int) -> list[int]:
    """BS distinct tokens starting at `first`."""
    return list(range(first, first + BS))


def _compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Allocate for every token of seq and mark them computed, as a finished prefill step would."""
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)


def _assert_pool_consistent(bm: BlockManager) -> None:
    for block in bm.blocks:
        assert (block.block_id in bm.free) == (block.ref_count == 0), block.block_id
        assert block.ref_count >= 0


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a, b = _seq(list(range(10, 19)), "a"), _seq(list(range(100, 102)), "b")
    assert bm.blocks_needed(a, 9) == 3
    bm.allocate(a, 9)
    bm.allocate(b, 2)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert not set(a.block_table) & set(b.block_table), "two sequences must never get the same fresh block"
    assert bm.num_free_blocks == 6
    # Growing within the last block takes nothing; crossing into a new block takes exactly one.
    bm.allocate(a, 12)
    assert bm.num_free_blocks == 6
    bm.allocate(a, 13)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 5
    # b's one block plus the 5 free ones hold 6 * BS tokens, and not one more.
    assert bm.can_allocate(b, 6 * BS) and not bm.can_allocate(b, 6 * BS + 1)
    _assert_pool_consistent(bm)
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert a.block_table == [] and b.block_table == []
    assert bm.num_free_blocks == bm.num_blocks == 10
    _assert_pool_consistent(bm)


def test_prefix_reused_only_once_computed_and_counted():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = _block(10) + _block(20) + _block(30)
    a = _seq(prefix + [7, 8], "a")
    bm.allocate(a, a.num_tokens)
    b = _seq(prefix + [9], "b")

    # a's blocks are allocated but nothing is computed yet: no reuse.
    bm.match_prefix(b)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.prefix_hits == 0

    # Only the first two blocks are computed (chunked prefill half-way): only they are reusable.
    a.num_computed_tokens = 2 * BS + 1
    bm.register_computed(a)
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:2]
    assert b.num_computed_tokens == 2 * BS
    assert bm.prefix_hits == 2
    bm.free_sequence(b)

    # Whole prompt computed: all three prefix blocks are reused.
    a.num_computed_tokens = a.num_tokens
    bm.register_computed(a)
    hits_before = bm.prefix_hits
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:3]
    assert b.num_computed_tokens == 3 * BS
    assert bm.prefix_hits - hits_before == 3
    assert b.num_uncomputed_tokens == 1
    _assert_pool_consistent(bm)


def test_prefix_hit_always_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = _block(10) + _block(20) + _block(30)  # exactly three full blocks
    a = _seq(prompt, "a")
    _compute_all(bm, a)
    b = _seq(prompt, "b")
    bm.match_prefix(b)
    # All three blocks are cached, but the last token must be computed to have logits to sample from.
    assert b.num_computed_tokens == 2 * BS
    assert b.num_uncomputed_tokens == BS
    assert b.num_computed_tokens < b.num_tokens

    # A one-token prompt never matches anything.
    c = _seq([10], "c")
    bm.match_prefix(c)
    assert c.block_table == [] and c.num_computed_tokens == 0


def test_hash_chain_distinguishes_equal_blocks_after_different_prefixes():
    shared = _block(50)
    assert chain_hash(chain_hash(None, _block(10)), shared) != chain_hash(chain_hash(None, _block(20)), shared)

    bm = BlockManager(num_blocks=16, block_size=BS)
    a = _seq(_block(10) + shared + [1], "a")
    b = _seq(_block(20) + shared + [1], "b")
    _compute_all(bm, a)
    _compute_all(bm, b)

    # Same second block, but after b's first block: it must map to b's second block, not a's.
    c = _seq(_block(20) + shared + [2], "c")
    bm.match_prefix(c)
    assert c.block_table == b.block_table[:2]

    # A sequence whose first block differs from both gets no hit at all, even though its second
    # block's tokens are cached twice.
    d = _seq(_block(90) + shared + [2], "d")
    bm.match_prefix(d)
    assert d.block_table == [] and d.num_computed_tokens == 0

    # Position matters too: the shared block's tokens as a first block are not a hit.
    e = _seq(shared + shared + [2], "e")
    bm.match_prefix(e)
    assert e.block_table == []


def test_freed_cached_blocks_revived_and_reused_blocks_lose_their_hash():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = _block(10) + _block(20) + [3]
    a = _seq(prompt, "a")
    _compute_all(bm, a)
    cached_ids = a.block_table[:2]
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4

    # The freed blocks kept their contents: a later identical prompt revives them from the free pool.
    b = _seq(prompt, "b")
    bm.match_prefix(b)
    assert b.block_table == cached_ids
    assert bm.num_free_blocks == 2
    assert all(bm.blocks[i].ref_count == 1 and i not in bm.free for i in cached_ids)
    bm.free_sequence(b)

    # New content takes every block, so the cached ones are overwritten and must lose their hashes.
    other = _seq(list(range(500, 500 + 4 * BS)), "other")
    bm.allocate(other, other.num_tokens)
    assert set(cached_ids) <= set(other.block_table)
    assert all(bm.blocks[i].hash is None for i in other.block_table)
    bm.free_sequence(other)

    c = _seq(prompt, "c")
    bm.match_prefix(c)
    assert c.block_table == [] and c.num_computed_tokens == 0, "stale blocks must not be served as a prefix hit"


def test_oldest_free_block_reused_first_keeps_recent_prefixes_alive():
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = _block(10) + _block(20) + [3]
    a = _seq(prompt, "a")
    _compute_all(bm, a)
    bm.free_sequence(a)
    # Three fresh blocks come from the blocks that were never used, not a's cached prefix.
    x = _seq(list(range(600, 600 + 3 * BS)), "x")
    bm.allocate(x, x.num_tokens)
    assert not set(x.block_table) & set(a.block_table)
    b = _seq(prompt, "b")
    bm.match_prefix(b)
    assert len(b.block_table) == 2


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = _block(10) + _block(20) + [1, 2]
    a = _seq(prompt, "a")
    _compute_all(bm, a)
    b = _seq(prompt, "b")
    bm.match_prefix(b)
    bm.allocate(b, b.num_tokens)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and b.block_table[2] != a.block_table[2]
    assert all(bm.blocks[i].ref_count == 2 for i in shared)
    assert bm.num_free_blocks == 8 - 4

    bm.free_sequence(a)
    # b still reads the shared prefix: it must stay out of the free pool (else it could be overwritten).
    assert all(bm.blocks[i].ref_count == 1 for i in shared)
    assert not set(shared) & set(bm.free)
    assert bm.num_free_blocks == 8 - 3
    # Allocating every free block never hands out a block b still holds.
    grab = _seq(list(range(700, 700 + bm.num_free_blocks * BS)), "grab")
    bm.allocate(grab, grab.num_tokens)
    assert not set(grab.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 0
    _assert_pool_consistent(bm)

    bm.free_sequence(grab)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in bm.blocks)
    _assert_pool_consistent(bm)


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = _block(10) + _block(20) + [1]
    a = _seq(prompt, "a")
    _compute_all(bm, a)
    assert all(bm.blocks[i].hash is None for i in a.block_table)
    b = _seq(prompt, "b")
    bm.match_prefix(b)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.prefix_hits == 0


@pytest.mark.parametrize("num_tokens", [1, BS, BS + 1, 3 * BS])
def test_blocks_needed_rounds_up(num_tokens):
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = _seq(list(range(num_tokens)))
    bm.allocate(s, num_tokens)
    assert len(s.block_table) == -(-num_tokens // BS)
    assert len(s.block_table) * BS >= num_tokens > (len(s.block_table) - 1) * BS


def test_every_whole_prompt_block_counts_as_a_query_found_or_not():
    """hits / queries is the share of prompt blocks found: a prompt whose first block alone is cached counts all
    its whole blocks as looked up (the last token never: it is always computed)."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = Sequence(0, list(range(9)), SamplingParams())
    bm.match_prefix(first)
    bm.allocate(first, 9)
    first.num_computed_tokens = 9
    bm.register_computed(first)
    bm.free_sequence(first)
    second = Sequence(1, list(range(4)) + [50] * 9, SamplingParams())  # 13 tokens: 3 whole blocks to look up
    queries, hits = bm.prefix_queries, bm.prefix_hits
    bm.match_prefix(second)
    assert (bm.prefix_queries - queries, bm.prefix_hits - hits) == (3, 1)
