"""The attention layer of a model: holds the head layout; the step's backend does the computing.

The cache of one layer is a pair of tensors [num_slots, kv_heads, head_dim] where slot = block * block_size
+ offset. Invariant: a slot holds the key/value of exactly one (sequence, position) pair, the one whose
block table maps to it; the scheduler never hands a block to two sequences unless both share that
prefix (prefix caching), in which case the contents are identical.
"""

from __future__ import annotations

import torch
from torch import nn


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_index: tuple[int, ...]) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.kv_index_tuple = tuple(kv_index)
        group = num_heads // num_kv_heads if num_heads % num_kv_heads == 0 else 0
        # The usual grouped layout lets kernels broadcast KV heads themselves; otherwise expand them by index.
        self.grouped = group > 0 and self.kv_index_tuple == tuple(i // group for i in range(num_heads))
        self.register_buffer("kv_index", torch.tensor(kv_index, dtype=torch.long), persistent=False)

    def forward(self, qk: torch.Tensor, v: torch.Tensor, rotary, cache: tuple[torch.Tensor, torch.Tensor],
                meta) -> torch.Tensor:
        """qk: [tokens, heads + kv_heads, dim], query heads first, not yet rotated; v: [tokens, kv_heads, dim].

        The backend rotates q and k with `rotary` (a RotaryLookup), stores k and v in the cache and attends.
        Returns [tokens, heads * dim].
        """
        return meta.backend.forward(self, qk, v, rotary, cache, meta)
