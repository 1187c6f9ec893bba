"""Paged attention on CUDA with the Triton kernels of shardserve/kernels/triton/paged_attention.py (prefill) and
paged_decode.py (decode).

Single-token chunks (decode) use a split-K flash-decoding kernel that reads each sequence's blocks
through its block table; longer chunks (prefill, chunked prefill, prefix-cache hits) use a
variable-length causal flash-attention kernel over the same cache. Decode metadata can live in
static buffers, which is how CUDA graphs replay it (engine/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardserve.attention.batch import StepBatch
from shardserve.kernels.triton.fused_ops import apply_rotary_and_store_
from shardserve.kernels.triton.paged_attention import paged_prefill_attention, store_kv_cache
from shardserve.kernels.triton.paged_decode import NewTokens, choose_num_splits, paged_decode_attention, rotary_mode
from shardserve.transfers import on_device


@dataclass
class TritonMetadata:
    backend: "TritonPagedBackend"
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 for padding rows (nothing stored)
    num_decode: int  # rows [0, num_decode) are one token of one sequence each
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32; 0 for padding rows (output zeros)
    num_splits: int  # how many parts each decode context is split into (fixed per CUDA graph)
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int32
    prefill_query_start: torch.Tensor | None = None  # [num_prefills + 1] int32, rows from num_decode
    prefill_context_lens: torch.Tensor | None = None  # [num_prefills] int32, including this step's tokens
    max_query_len: int = 0
    # Zeroed int32 counts, at least num_decode * num_kv_heads, that the split decode's fused combine leaves at
    # zero; None: the device's shared arrival counts (kernels/triton/arrivals.py).
    decode_arrivals: torch.Tensor | None = None
    # Decode rows of one sequence side by side (StepBatch.decode_rows): every row's key is stored before any row
    # attends, so the decode launch does not store its rows' keys itself (that suits one row a sequence only).
    rows_share_sequences: bool = False


def _head_norm_args(layer) -> tuple | None:
    """(query weight, key weight, eps) of the layer's head norms (Qwen3's), as the fused kernels take them."""
    if layer.head_norm is None:
        return None
    q_norm, k_norm = layer.head_norm
    return q_norm.weight, k_norm.weight, q_norm.eps


def block_table_array(tables: list[list[int]], width: int | None = None) -> np.ndarray:
    width = width or max((len(t) for t in tables), default=1) or 1
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t[:width]
    return out


class TritonPagedBackend:
    name = "triton-paged"
    fuses_head_norm = True  # the head norm runs inside the rotary kernel

    def __init__(self, device: torch.device, block_size: int, num_kv_heads: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        # On CPU tensors the kernels run in Triton's interpreter (tests): one "SM".
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def num_splits(self, batch_size: int, max_context: int) -> int:
        return choose_num_splits(batch_size, self.num_kv_heads, max_context, self.num_sms, self.block_size)

    def _to_device(self, array) -> torch.Tensor:
        return on_device(np.ascontiguousarray(array), self.device)

    def build_metadata(self, batch: StepBatch) -> TritonMetadata:
        nd = batch.num_decode
        slot_mapping = self._to_device(np.asarray(batch.slot_mapping, dtype=np.int64))
        decode_tables = decode_lens = None
        num_splits = 1
        if nd:
            lens = [batch.context_len(i) for i in range(nd)]
            decode_tables = self._to_device(block_table_array([c.block_table for c in batch.chunks[:nd]]))
            decode_lens = self._to_device(np.asarray(lens, dtype=np.int32))
            num_splits = self.num_splits(nd, max(lens))
        meta = TritonMetadata(self, slot_mapping, nd, decode_tables, decode_lens, num_splits,
                              rows_share_sequences=batch.rows_share_sequences)
        if nd < len(batch.chunks):
            prefills = range(nd, len(batch.chunks))
            starts = np.asarray(batch.row_start[nd:], dtype=np.int32) - batch.row_start[nd]
            meta.prefill_block_tables = self._to_device(block_table_array([batch.chunks[i].block_table
                                                                           for i in prefills]))
            meta.prefill_query_start = self._to_device(starts)
            meta.prefill_context_lens = self._to_device(np.asarray([batch.context_len(i) for i in prefills],
                                                                   dtype=np.int32))
            meta.max_query_len = int(np.diff(starts).max())
        return meta

    def forward(self, layer, qk: torch.Tensor, v: torch.Tensor, rotary, cache: tuple[torch.Tensor, torch.Tensor],
                meta: TritonMetadata) -> torch.Tensor:
        """qk: [tokens, heads + kv_heads, dim] before the head norm and the rotation; v: [tokens, kv_heads, dim].
        Returns [tokens, heads * dim]. One kernel normalises (layer.head_norm) and rotates q and k and writes k
        and v to the cache; in a decode-only step that is the decode attention launch itself (rotary_mode)."""
        if self._decodes_in_one_launch(rotary, meta):
            return self._decode_in_one_launch(layer, qk[:, :layer.num_heads], qk[:, layer.num_heads:], v, rotary,
                                              cache, meta)
        k_cache, v_cache = cache
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)  # an FP8 cache's (attention/kv_quant.py)
        # The rotary kernel that also stores the cache rotates whole heads; a partial rotation (Qwen3-Next: the
        # first quarter of each head) goes through rotary.apply, which rotates those dims only, and a separate
        # cache store (a decode-only step's launch rotates either).
        if rotary.positions is not None and rotary.cos.shape[-1] == qk.shape[-1]:
            apply_rotary_and_store_(qk, layer.num_heads, v, rotary.positions, rotary.cos, rotary.signed_sin,
                                    k_cache, v_cache, meta.slot_mapping, _head_norm_args(layer), **scales)
        else:
            if layer.head_norm is not None:
                qk = layer.normed_heads(qk)
            qk = rotary.apply(qk)
            store_kv_cache(qk[:, layer.num_heads:], v, k_cache, v_cache, meta.slot_mapping, **scales)
        q = qk[:, :layer.num_heads]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decode
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                   layer.scale, self.block_size, meta.num_splits, out=out[:nd],
                                   arrivals=meta.decode_arrivals, **scales)
        if meta.prefill_query_start is not None:
            paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                                    meta.prefill_context_lens, meta.max_query_len, layer.scale, self.block_size,
                                    out=out[nd:], **scales)
        return out.view(q.shape[0], -1)

    def forward_apart(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary,
                      cache: tuple[torch.Tensor, torch.Tensor], meta: TritonMetadata,
                      gate: torch.Tensor | None = None) -> torch.Tensor | None:
        """forward with the query heads q [tokens, heads, dim] and the key heads k [tokens, kv_heads, dim] apart
        (strided views, as a gated attention's q projection interleaves query and gate rows), the output times
        sigmoid(gate) where a gate is given: a decode-only step reads them where they are and gates its output,
        in its one launch; None for other steps (the caller stacks them and gates)."""
        if not self._decodes_in_one_launch(rotary, meta):
            return None
        return self._decode_in_one_launch(layer, q, k, v, rotary, cache, meta, gate)

    @staticmethod
    def _decodes_in_one_launch(rotary, meta: TritonMetadata) -> bool:
        """Whether the step is decode only and its launch normalises and rotates the heads (whole or the tables'
        first dims) and stores the new keys itself (rotary_mode "fused")."""
        return (rotary.positions is not None and meta.prefill_query_start is None and not meta.rows_share_sequences
                and rotary_mode() == "fused")

    def _decode_in_one_launch(self, layer, q, k, v, rotary, cache, meta: TritonMetadata,
                              gate: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = cache
        new = NewTokens(k, v, meta.slot_mapping, rotary.cos, rotary.signed_sin, _head_norm_args(layer))
        out = paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                     layer.scale, self.block_size, meta.num_splits, arrivals=meta.decode_arrivals,
                                     new_tokens=new, next_early=layer.launches_next_early, k_scale=layer.k_scale,
                                     v_scale=layer.v_scale, gate=gate)
        return out.view(q.shape[0], -1)

    # -- static buffers for CUDA graphs ----------------------------------------------------------
    def static_decode_metadata(self, max_batch: int, max_blocks: int) -> TritonMetadata:
        """Decode metadata in fixed buffers, sized for the largest graph batch. Made before any capture, and
        kept as long as the graphs: they hold the addresses, the arrival counts' among them."""
        return TritonMetadata(
            self,
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=self.device),
            num_decode=max_batch,
            decode_block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=self.device),
            decode_context_lens=torch.zeros(max_batch, dtype=torch.int32, device=self.device),
            num_splits=1,
            decode_arrivals=torch.zeros(max_batch * self.num_kv_heads, dtype=torch.int32, device=self.device),
        )

    def graph_view(self, static: TritonMetadata, batch_size: int, max_context: int,
                   rows_share_sequences: bool = False) -> TritonMetadata:
        """The first batch_size rows of the static buffers, as a graph of that size captures them."""
        return TritonMetadata(self, static.slot_mapping[:batch_size], batch_size,
                              static.decode_block_tables[:batch_size], static.decode_context_lens[:batch_size],
                              self.num_splits(batch_size, max_context), decode_arrivals=static.decode_arrivals,
                              rows_share_sequences=rows_share_sequences)
