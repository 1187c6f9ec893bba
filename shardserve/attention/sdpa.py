"""Attention over gathered cache slots (CPUs, fallback).

Single-token chunks are batched against a padded context, computed in float32 as two batched matmuls
per group of query heads sharing a KV head, with a -inf bias on the padding; each longer chunk runs on
its own through torch's scaled_dot_product_attention. Keys and values go into the cache encoded as its dtype says
(attention/kv_quant.py: FP8 with the layer's scales) and are read back decoded, so attention sees what the cache
holds. On CPUs torch's SDPA with a padding mask is several
times slower for a batch of single-token queries (and slower still in bfloat16) than the two matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardserve.attention import kv_quant
from shardserve.attention.batch import StepBatch


@dataclass
class PrefillChunk:
    """A sequence computing more than one token this step: tokens [start, end) of the flat batch."""

    start: int
    end: int
    context_slots: torch.Tensor  # [context_len] slots of every position up to this chunk's last token
    first_position: int  # position of the chunk's first token (= tokens already in the cache before it)


@dataclass
class SdpaMetadata:
    backend: "SdpaBackend"
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key/value goes
    num_single: int
    single_slots: torch.Tensor | None  # [num_single, max_context] slots, padded
    single_bias: torch.Tensor | None  # [num_single, 1, 1, max_context] float32: 0 on real slots, -inf on padding
    prefills: list[PrefillChunk]


class SdpaBackend:
    name = "torch-sdpa"
    fuses_head_norm = False

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size

    def build_metadata(self, batch: StepBatch) -> SdpaMetadata:
        bs = self.block_size
        prefills = []
        for i in range(batch.num_decode, len(batch.chunks)):
            c = batch.chunks[i]
            end = batch.context_len(i)
            slots = [c.block_table[p // bs] * bs + p % bs for p in range(end)]
            prefills.append(PrefillChunk(batch.row_start[i], batch.row_start[i + 1],
                                         torch.tensor(slots, device=self.device), c.start_position))
        single_slots, single_bias = self._single_tables(batch)
        return SdpaMetadata(self, torch.tensor(batch.slot_mapping, dtype=torch.long, device=self.device),
                            batch.num_decode, single_slots, single_bias, prefills)

    def _single_tables(self, batch: StepBatch):
        """Padded [n, max_context] slot table and validity mask for the single-token chunks."""
        n = batch.num_decode
        if not n:
            return None, None
        bs = self.block_size
        context_lens = torch.tensor([batch.context_len(i) for i in range(n)])
        max_context = int(context_lens.max())
        max_blocks = -(-max_context // bs)
        tables = torch.zeros(n, max_blocks, dtype=torch.long)
        for i in range(n):
            used = batch.chunks[i].block_table[:max_blocks]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.long)
        pos = torch.arange(max_context)
        valid = pos.unsqueeze(0) < context_lens.unsqueeze(1)
        # Padding past a sequence's context reads slot 0 (block 0 is zeroed, never NaN), not the unwritten
        # rest of its own last block: the cache is uninitialised, and a masked-out NaN still poisons the sum.
        slots = torch.where(valid, tables[:, pos // bs] * bs + pos % bs, 0)
        bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
        return slots.to(self.device), bias[:, None, None, :].to(self.device)

    def forward(self, layer, qk: torch.Tensor, v: torch.Tensor, rotary, cache: tuple[torch.Tensor, torch.Tensor],
                meta: SdpaMetadata) -> torch.Tensor:
        """qk: [tokens, heads + kv_heads, dim] before rotation; v: [tokens, kv_heads, dim].
        Returns [tokens, heads * dim]."""
        q, k = rotary.apply(qk).split([layer.num_heads, layer.num_kv_heads], dim=1)
        k_cache, v_cache = cache
        kv_quant.store(k_cache, meta.slot_mapping, k, layer.k_scale)
        kv_quant.store(v_cache, meta.slot_mapping, v, layer.v_scale)
        n = meta.num_single
        if n and not meta.prefills:  # decode only: no output buffer to assemble
            return self._single(layer, q, k_cache, v_cache, meta).reshape(n, -1)
        out = torch.empty_like(q)
        if n:
            out[:n] = self._single(layer, q[:n], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, len, dim]
            kc = _heads_first(layer, _read(k_cache, chunk.context_slots, layer.k_scale, q.dtype).unsqueeze(0))
            vc = _heads_first(layer, _read(v_cache, chunk.context_slots, layer.v_scale, q.dtype).unsqueeze(0))
            out[chunk.start:chunk.end] = _causal(layer, qc, kc, vc, chunk.first_position)[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)

    def _single(self, layer, q, k_cache, v_cache, meta: SdpaMetadata) -> torch.Tensor:
        """One query token per sequence against its padded context: [n, heads, dim] in q's dtype."""
        # [n, kv_heads (or heads), ctx, dim] in float32
        ks = _heads_first(layer, _read(k_cache, meta.single_slots, layer.k_scale, torch.float32))
        vs = _heads_first(layer, _read(v_cache, meta.single_slots, layer.v_scale, torch.float32))
        n, heads, dim = q.shape
        kv_heads = ks.shape[1]
        # Query heads h * group .. (h + 1) * group - 1 read KV head h (after _heads_first, group is 1 where
        # the heads were expanded instead).
        grouped_q = q.float().view(n, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(grouped_q, ks.transpose(-1, -2)).mul_(layer.scale).add_(meta.single_bias)
        out = torch.matmul(torch.softmax(scores, dim=-1), vs)
        return out.view(n, heads, dim).to(q.dtype)


def _read(cache: torch.Tensor, slots: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The cache's values at `slots` (any shape), decoded to `dtype`."""
    return kv_quant.decode(cache[slots], scale, dtype)


def _heads_first(layer, x: torch.Tensor) -> torch.Tensor:
    """[batch, ctx, kv_heads, dim] -> [batch, heads or kv_heads, ctx, dim]."""
    x = x.transpose(1, 2)
    return x if layer.grouped else x.index_select(1, layer.kv_index)


def _sdpa(layer, q, k, v, mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=layer.scale,
                                          enable_gqa=layer.grouped and layer.num_heads != layer.num_kv_heads)


def _causal(layer, q, k, v, first_position: int):
    length, context = q.shape[2], k.shape[2]
    if first_position == 0 and length == context:
        return _sdpa(layer, q, k, v, is_causal=True)
    # Query i sits at position first_position + i and sees every position up to its own.
    query_pos = torch.arange(first_position, first_position + length, device=q.device).unsqueeze(1)
    mask = torch.arange(context, device=q.device).unsqueeze(0) <= query_pos
    return _sdpa(layer, q, k, v, mask=mask)
