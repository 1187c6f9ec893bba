"""Fixed-size KV-cache blocks: allocation, reference counts and prefix caching by hash chain.

A full block's hash covers its own tokens and, through its parent's hash, every token before it, so
equal hashes mean equal prefixes. Invariants:
- a block is in `free` exactly when its reference count is 0; free blocks are reused oldest first;
- a free block that still has a hash keeps its contents and can be revived by a later prefix hit
  until it is handed out for something else;
- a hash is registered only once every token of its block is in the cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from shardserve.engine.sequence import Sequence


def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.prefix_queries = 0  # whole prompt blocks looked up in the prefix cache
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more blocks seq needs to hold its first num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold num_tokens tokens. Caller checked can_allocate."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free())

    def match_prefix(self, seq: Sequence) -> None:
        """For a sequence with no blocks yet, reuse cached blocks of its longest cached prefix.

        At least one token is always left to compute, so the step that finishes the prompt has
        logits to sample from.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return
        parent = None
        usable = (seq.num_tokens - 1) // self.block_size
        # Every whole block of the prompt counts as looked up, found or not (the lookup stops at the first miss), so
        # prefix_hits / prefix_queries is the share of prompt blocks found.
        self.prefix_queries += usable
        for i in range(usable):
            parent = chain_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            self.prefix_hits += 1
            self._acquire(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def register_computed(self, seq: Sequence) -> None:
        """Publish the hashes of seq's blocks that are full and fully computed. Only the blocks after the
        ones already hashed are looked at (seq.num_hashed_blocks: every block before it has a hash), so a step
        costs the blocks it filled, not the whole table."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_hashed_blocks
        if not self.enable_prefix_caching or full <= start:  # no block filled since the last call (most decode steps)
            return
        parent = self.blocks[seq.block_table[start - 1]].hash if start else None
        for i in range(start, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = chain_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                # An identical block computed by another sequence may already be registered; keep that one.
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
        seq.num_hashed_blocks = full

    def free_sequence(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are reused before its shared prefix.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash = None
        block.ref_count = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
