"""DeepSeek's multi-head latent attention (MLA, DeepSeek-V2 and V3) over a paged latent cache.

Per token: the query of each head, [q_nope (N) | q_rope (R)], from q_proj (or q_b_proj(q_a_layernorm(q_a_proj)))
; one latent of L features (kv_a_layernorm of the first L outputs of kv_a_proj_with_mqa) and one rope key of R
features (its last R, rotated), shared by all heads. kv_b_proj expands a latent into each head's key part k_nope (N)
and value (V): head h's rows [h (N + V), h (N + V) + N) and the next V. Attention per head: softmax(scale *
[q_nope | q_rope] . [k_nope | k_rope]) . v, then o_proj over the heads' values.

The cache holds [latent | rotated rope key] once per token (attention/mla.py), never per head. Two equal forms read
it:
- expanded (chunks of more than one token: prefill): kv_b_proj expands the whole context's latents into per-head
  keys and values, and attention runs as usual;
- absorbed (one-token chunks: decode): q_nope . k_nope = (W_UK^T q_nope) . latent, so each head's query becomes
  [W_UK^T q_nope | q_rope] (L + R), scored against the cache entries themselves; the weighted sum of latents, times
  W_UV, is the head's value output. Decode reads only the cache (the backend's `decode`, attention/mla.mla_decode's
  signature: a device kernel can take its place).

Tensor parallel: heads split by rank (q_proj / q_b_proj and kv_b_proj by rows, o_proj by columns, all-reduced once);
q_a_proj, kv_a_proj_with_mqa and their norms replicated, and so is the cache (every rank stores every token's
latent). Heads that do not split evenly are kept whole on every rank (layers/sharding.attention_shard, logged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.attention import kv_quant
from shardserve.distributed.communicator import NORMED, Communicator, reduced_first
from shardserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryLookup, yarn_mscale
from shardserve.layers.sharding import attention_shard


@dataclass(frozen=True)
class MlaDims:
    """An MLA layer's sizes (ModelConfig's fields of the same names); q_lora_rank 0: q_proj, no bottleneck."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    eps: float
    scale: float  # the softmax scale (softmax_scale)
    interleaved: bool  # the rotated dims pair up as (0, 1), (2, 3)...
    ab_bias: bool = False  # q_a_proj and kv_a_proj_with_mqa carry biases (attention_bias)
    o_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def entry_width(self) -> int:
        """A cache entry's features: the latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def of(cls, cfg) -> "MlaDims":
        return cls(cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                   cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rms_norm_eps,
                   softmax_scale(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.rope_scaling), cfg.rope_interleave,
                   cfg.qkv_bias, cfg.o_bias)


def softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """qk_head_dim^-1/2, times mscale^2 under YaRN with mscale_all_dim (mscale = 0.1 mscale_all_dim ln(factor) + 1),
    as DeepSeek's attention scales its scores (beside YaRN's factor on the rotary tables)."""
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """x's last dim reordered as [even dims | odd dims]: pairs (2i, 2i + 1) become (i, i + R/2), which rotate-half
    turns as the interleaved rotation turns the pairs. Queries and keys are reordered alike, so their products
    are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """One MLA block on norm(x + residual), called as LlamaAttention is; see the module's docstring."""

    def __init__(self, dims: MlaDims, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = d = dims
        shard = attention_shard(d.num_heads, d.num_heads, d.qk_head_dim, comm.rank, comm.world_size,
                                "latent attention")
        self.shard = shard
        h0, h1 = shard.q_heads
        self.num_heads = shard.num_q
        qk, kv = d.qk_head_dim, d.qk_nope_head_dim + d.v_head_dim
        self.q_a_proj = self.q_a_layernorm = self.q_b_proj = self.q_proj = None
        if d.q_lora_rank:
            self.q_a_proj = _replicated(d.hidden_size, d.q_lora_rank, d.ab_bias, dtype)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, d.eps, dtype)
            self.q_b_proj = ColumnParallelLinear(d.q_lora_rank, {None: (h0 * qk, h1 * qk)}, False, dtype)
        else:
            self.q_proj = ColumnParallelLinear(d.hidden_size, {None: (h0 * qk, h1 * qk)}, False, dtype)
        self.kv_a_proj_with_mqa = _replicated(d.hidden_size, d.entry_width, d.ab_bias, dtype)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, d.eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(d.kv_lora_rank, {None: (h0 * kv, h1 * kv)}, False, dtype)
        # The absorbed form reads its weight as W_UK and W_UV: a quantized checkpoint's is read as the values it
        # encodes at load (never kept packed).
        self.kv_b_proj.keeps_dense_weight = True
        self.o_proj = RowParallelLinear((h0 * d.v_head_dim, h1 * d.v_head_dim), d.hidden_size, d.o_bias, dtype,
                                        comm if shard.sharded else None)
        for layer in (self.q_b_proj, self.q_proj, self.kv_b_proj, self.o_proj):
            if layer is not None:
                layer.replicated = not shard.sharded
        self.o_proj.defer()

    def forward(self, rotary: RotaryLookup, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                cache: tuple[torch.Tensor, ...], meta, reduce=None, next_norm: RMSNorm | None = None):
        """(output, new residual, the output's pending reduction), as LlamaAttention.forward."""
        x, residual, reduce = reduced_first(x, residual, norm, reduce)
        if reduce is NORMED:
            h = x
        else:
            h, residual = norm.with_sum(x, residual)
        out = self.attention(h, rotary, cache[0], meta)
        return self.o_proj.forward_add(out, residual, next_norm)

    def attention(self, h: torch.Tensor, rotary: RotaryLookup, cache: torch.Tensor, meta) -> torch.Tensor:
        """The heads' values [T, heads * V] for the normed hidden states h [T, hidden], storing each token's cache
        entry first (cache: [num_slots, 1, L + R])."""
        d, tokens = self.dims, h.shape[0]
        q = self.q_proj(h) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q_nope, q_rope = q.view(tokens, self.num_heads, d.qk_head_dim).split([d.qk_nope_head_dim, d.qk_rope_head_dim],
                                                                              dim=-1)
        kv = self.kv_a_proj_with_mqa(h)
        entries = cache.view(-1, d.entry_width)
        if (meta.backend.fuses_decode and not meta.prefills and rotary.positions is not None
                and rotary.cos.shape[-1] == d.qk_rope_head_dim):
            return self.fused_decode(q.view(tokens, self.num_heads, d.qk_head_dim), kv, rotary, entries, meta)
        latent, k_rope = kv.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = self._rotated(rotary, q_rope, k_rope)
        kv_quant.store(entries, meta.slot_mapping, torch.cat((self.kv_a_layernorm(latent.contiguous()), k_rope), -1),
                       1.0, padded=meta.padded)
        out = torch.empty(tokens, self.num_heads, d.v_head_dim, dtype=h.dtype, device=h.device)
        nd = meta.num_decode
        if nd:
            out[:nd] = self.absorbed(q_nope[:nd], q_rope[:nd], entries, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.end)
            context = kv_quant.decode(entries[chunk.context_slots], 1.0, h.dtype)
            out[rows] = self.expanded(q_nope[rows], q_rope[rows], context, chunk.first_position)
        return out.view(tokens, -1)

    def _rotated(self, rotary: RotaryLookup, q_rope: torch.Tensor, k_rope: torch.Tensor):
        """(q_rope [T, heads, R], k_rope [T, R]) rotated at their tokens' positions, queries and key together."""
        heads = q_rope.shape[1]
        qk = torch.cat((q_rope, k_rope.unsqueeze(1)), dim=1)
        if self.dims.interleaved:
            qk = deinterleaved(qk)
        qk = rotary.apply(qk.contiguous())
        return qk[:, :heads], qk[:, heads]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, N, L], W_UV [heads, V, L]): views of kv_b_proj's weight, this rank's heads."""
        d = self.dims
        w = self.kv_b_proj.weight.view(self.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return w.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor, meta) -> torch.Tensor:
        """Decode rows' values [B, heads, V]: the absorbed query [W_UK^T q_nope | q_rope] against the cache, then
        the weighted latents times W_UV."""
        w_uk, w_uv = self.absorbed_weights()
        q = absorbed_query(q_nope, q_rope, w_uk)
        latent_out = meta.backend.decode(q, entries, meta.decode_block_tables, meta.decode_context_lens,
                                         meta.backend.block_size, self.dims.scale, self.dims.kv_lora_rank)
        return latent_values(latent_out, w_uv)

    def fused_decode(self, q: torch.Tensor, kv: torch.Tensor, rotary: RotaryLookup, entries: torch.Tensor,
                     meta) -> torch.Tensor:
        """A decode-only step on the Triton kernels (kernels/triton/mla_decode.py), the same numbers as the torch
        path above in five launches besides the projections: one stores the entries and rotates the queries, a
        batched product absorbs W_UK (few_rows_bmm: its own kernel for a few tokens, cuBLAS's beyond), the decode
        (and its split combine) attends, a batched product applies W_UV.
        q: [T, heads, N + R]; kv: kv_a_proj_with_mqa's output [T, L + R]. Returns the heads' values [T, heads * V].
        The latent queries and the decode's output stay head-major ([heads, T, L]), as the batched products take
        and give them."""
        from shardserve.kernels.triton.mla_decode import few_rows_bmm, mla_decode, store_entries_rotate_queries

        d, tokens = self.dims, q.shape[0]
        q_rope = store_entries_rotate_queries(kv, q[..., d.qk_nope_head_dim:], self.kv_a_layernorm.weight,
                                              self.kv_a_layernorm.eps, rotary.positions, rotary.cos,
                                              rotary.signed_sin, entries, meta.slot_mapping, d.interleaved)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = few_rows_bmm(q[..., :d.qk_nope_head_dim].transpose(0, 1), w_uk)  # [heads, T, L]
        latent_out = torch.empty_like(q_latent)
        mla_decode(q_latent.transpose(0, 1), entries, meta.decode_block_tables, meta.decode_context_lens,
                   meta.backend.block_size, d.scale, d.kv_lora_rank, out=latent_out.transpose(0, 1), q_rope=q_rope)
        values = few_rows_bmm(latent_out, w_uv.transpose(1, 2))  # [heads, T, V]
        return values.transpose(0, 1).reshape(tokens, -1)

    def expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, context: torch.Tensor,
                 first_position: int) -> torch.Tensor:
        """A chunk's values [n, heads, V] for its queries (at positions first_position...) over its whole context's
        cache entries [C, L + R], each query seeing the positions up to its own."""
        d = self.dims
        kv = self.kv_b_proj(context[:, :d.kv_lora_rank].contiguous()).view(-1, self.num_heads,
                                                                            d.qk_nope_head_dim + d.v_head_dim)
        return expanded_attention(q_nope, q_rope, kv, context[:, d.kv_lora_rank:], d.qk_nope_head_dim, d.scale,
                                  first_position)


def absorbed_query(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[W_UK_h^T q_nope_h | q_rope_h] for each head: [B, heads, L + R] from q_nope [B, heads, N], q_rope
    [B, heads, R] and W_UK [heads, N, L]."""
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [B, heads, L]
    return torch.cat((q_latent, q_rope), dim=-1)


def latent_values(latent_out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Each head's value output W_UV_h o_h [B, heads, V] from its weighted latents o [B, heads, L]."""
    return torch.bmm(latent_out.transpose(0, 1), w_uv.to(latent_out.dtype).transpose(1, 2)).transpose(0, 1)


def expanded_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor,
                       nope: int, scale: float, first_position: int) -> torch.Tensor:
    """Causal attention of queries [n, heads, N] / [n, heads, R] at positions first_position... over a context's
    expanded keys and values kv [C, heads, N + V] and shared rope keys k_rope [C, R]: [n, heads, V]."""
    n, heads = q_nope.shape[:2]
    context = kv.shape[0]
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)  # [heads, n, N + R]
    k = torch.cat((k_nope, k_rope.unsqueeze(1).expand(context, heads, -1)), dim=-1).transpose(0, 1)
    query_pos = torch.arange(first_position, first_position + n, device=q.device).unsqueeze(1)
    mask = torch.arange(context, device=q.device).unsqueeze(0) <= query_pos
    out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _replicated(inputs: int, outputs: int, bias: bool, dtype: torch.dtype) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(inputs, {None: (0, outputs)}, bias, dtype)
    layer.replicated = True
    return layer


def check_reference(dims: MlaDims, heads: int, context: int, dtype: torch.dtype, device: torch.device,
                    block_size: int, decode=None) -> float:
    """Relative error of the absorbed decode (through `decode`, attention/mla.mla_decode by default) against the
    expanded form in float64, for one query token over `context` random cache entries, with `heads` heads of these
    sizes and a random kv_b_proj weight: the two forms' agreement that start-up checks."""
    from shardserve.attention.mla import mla_decode
    from shardserve.kernels.self_check import relative_error

    g = torch.Generator(device="cpu").manual_seed(0)
    n, r, v, latent = dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, dims.kv_lora_rank

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(device)

    w = rand(heads * (n + v), latent, std=latent ** -0.5)
    q_nope, q_rope = rand(1, heads, n), rand(1, heads, r)
    blocks = -(-context // block_size)
    entries = rand((blocks + 1) * block_size, dims.entry_width)
    entries[:block_size] = 0  # block 0, as the engine keeps it
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=device).unsqueeze(0)
    lens = torch.tensor([context], dtype=torch.int32, device=device)
    ctx = entries[block_size:block_size + context]
    kv = (ctx[:, :latent] @ w.T).view(context, heads, n + v)
    want = expanded_attention(q_nope, q_rope, kv, ctx[:, latent:], n, dims.scale, context - 1)
    w_uk, w_uv = w.to(dtype).view(heads, n + v, latent).split([n, v], dim=1)
    q = absorbed_query(q_nope.to(dtype), q_rope.to(dtype), w_uk)
    latent_out = (decode or mla_decode)(q, entries.to(dtype), table, lens, block_size, dims.scale, latent)
    return relative_error(latent_values(latent_out, w_uv), want.cpu())
