"""Attention over a paged KV cache.

The cache of one layer is a pair of tensors [num_slots, kv_heads, head_dim] where slot = block * block_size
+ offset. Invariant: a slot holds the key/value of exactly one (sequence, position) pair, the one whose
block table maps to it; the scheduler never hands a block to two sequences unless both share that
prefix (prefix caching), in which case the contents are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillChunk:
    """A sequence computing more than one token this step: tokens [start, end) of the flat batch."""

    start: int
    end: int
    context_slots: torch.Tensor  # [context_len] slots of every position up to this chunk's last token
    first_position: int  # position of the chunk's first token (= tokens already in the cache before it)


@dataclass
class AttentionMetadata:
    """How the flat batch of tokens maps onto sequences and cache slots for one step.

    Tokens [0, num_single) each belong to a different sequence that computes one token (decode);
    the rest belong to `prefills`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key/value goes
    num_single: int
    single_slots: torch.Tensor | None  # [num_single, max_context] slots, padded
    single_mask: torch.Tensor | None  # [num_single, 1, 1, max_context] True where a slot is real
    prefills: list[PrefillChunk]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_index: tuple[int, ...]) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        group = num_heads // num_kv_heads if num_heads % num_kv_heads == 0 else 0
        # The usual grouped layout lets SDPA broadcast KV heads itself; otherwise expand them by index.
        self.grouped = group > 0 and kv_index == tuple(i // group for i in range(num_heads))
        self.register_buffer("kv_index", torch.tensor(kv_index, dtype=torch.long), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]. Returns [tokens, heads * dim]."""
        k_cache, v_cache = cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        n = meta.num_single
        if n and not meta.prefills:  # decode only: no output buffer to assemble
            return self._single(q, k_cache, v_cache, meta).reshape(n, -1)
        out = torch.empty_like(q)
        if n:
            out[:n] = self._single(q[:n], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, len, dim]
            kc = self._heads_first(k_cache[chunk.context_slots].unsqueeze(0))
            vc = self._heads_first(v_cache[chunk.context_slots].unsqueeze(0))
            out[chunk.start:chunk.end] = self._causal(qc, kc, vc, chunk.first_position)[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)

    def _single(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One query token per sequence against its padded context: [n, heads, dim]."""
        ks = self._heads_first(k_cache[meta.single_slots])  # [n, heads, ctx, dim]
        vs = self._heads_first(v_cache[meta.single_slots])
        return self._sdpa(q.unsqueeze(2), ks, vs, mask=meta.single_mask).squeeze(2)

    def _heads_first(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, ctx, kv_heads, dim] -> [batch, heads or kv_heads, ctx, dim]."""
        x = x.transpose(1, 2)
        return x if self.grouped else x.index_select(1, self.kv_index)

    def _sdpa(self, q, k, v, mask=None, is_causal=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                              enable_gqa=self.grouped and self.num_heads != self.num_kv_heads)

    def _causal(self, q, k, v, first_position: int):
        length, context = q.shape[2], k.shape[2]
        if first_position == 0 and length == context:
            return self._sdpa(q, k, v, is_causal=True)
        # Query i sits at position first_position + i and sees every position up to its own.
        query_pos = torch.arange(first_position, first_position + length, device=q.device).unsqueeze(1)
        mask = torch.arange(context, device=q.device).unsqueeze(0) <= query_pos
        return self._sdpa(q, k, v, mask=mask)
