"""The attention layer of a model: holds the head layout; the step's backend does the computing.

The cache of one layer is a pair of tensors [num_slots, kv_heads, head_dim] where slot = block * block_size
+ offset. Invariant: a slot holds the key/value of exactly one (sequence, position) pair, the one whose
block table maps to it; the scheduler never hands a block to two sequences unless both share that
prefix (prefix caching), in which case the contents are identical.
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.availability import use_triton


class PagedAttention(nn.Module):
    # Qwen3's per-head RMSNorms (query norm, key norm), applied to qk before the rotation, or None. Held, not
    # registered: their weights belong to the attention block that loads them.
    head_norm: tuple[nn.Module, nn.Module] | None = None
    # Decode attention lets the next kernel (the o projection's GEMV) launch at its start: set where that GEMV loads
    # all its rows before its wait (overlap_with_o_projection).
    launches_next_early = False
    # The FP8 cache's scales (attention/kv_quant.py): a key or value x is stored as x / scale in e4m3 and read as
    # stored * scale. Plain floats, the same on every rank, set by the checkpoint's k_scale / v_scale tensors
    # (kv_scales_loaded) and kept across sleep and wake; unused by 16-bit caches.
    k_scale = 1.0
    v_scale = 1.0
    kv_scales_loaded = False

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
        """qk: [tokens, heads + kv_heads, dim], query heads first, not yet normed or rotated; v: [tokens,
        kv_heads, dim].

        The backend normalises the heads (head_norm, unless it fuses that itself), rotates q and k with `rotary`
        (a RotaryLookup), stores k and v in the cache and attends. Returns [tokens, heads * dim].
        """
        if self.head_norm is not None and not meta.backend.fuses_head_norm:
            qk = self.normed_heads(qk)
        return meta.backend.forward(self, qk, v, rotary, cache, meta)

    def forward_apart(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary,
                      cache: tuple[torch.Tensor, torch.Tensor], meta, gate: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """forward with the query heads q [tokens, heads, dim] and the key heads k [tokens, kv_heads, dim] in
        tensors of their own (strided views allowed: a gated attention's q projection interleaves query and gate
        rows), and the output times sigmoid(gate) [tokens, heads, dim] where a gate is given (sigmoid_gated). A
        backend that takes them apart (the Triton backend's one-launch decode, which normalises the heads and
        gates the output itself) reads them where they are; otherwise they are stacked into forward's qk first."""
        take_apart = getattr(meta.backend, "forward_apart", None)
        if take_apart is not None and meta.backend.fuses_head_norm:
            out = take_apart(self, q, k, v, rotary, cache, meta, gate)
            if out is not None:
                return out
        out = self.forward(torch.cat((q, k), dim=1), v, rotary, cache, meta)
        return out if gate is None else sigmoid_gated(out, gate)

    def set_kv_scale(self, kind: str, value: float) -> None:
        """kind "k", "v" or "kv" (one scale for both, as older FP8 checkpoints store it)."""
        if "k" in kind:
            self.k_scale = value
        if "v" in kind:
            self.v_scale = value
        self.kv_scales_loaded = True

    def normed_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """head_norm applied to qk's query heads and key heads (in place where a kernel does it)."""
        q_norm, k_norm = self.head_norm
        if use_triton(qk) and not self.head_dim & (self.head_dim - 1):
            from shardserve.kernels.triton.fused_ops import qk_rms_norm_

            return qk_rms_norm_(qk, self.num_heads, q_norm.weight, k_norm.weight, q_norm.eps)  # one launch
        return torch.cat((q_norm(qk[:, :self.num_heads]), k_norm(qk[:, self.num_heads:])), dim=1)


def sigmoid_gated(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [tokens, heads * D] times sigmoid(gate [tokens, heads, D]): in place in one launch on GPUs."""
    if use_triton(out) and out.is_contiguous():
        from shardserve.kernels.triton.fused_ops import sigmoid_gate_

        return sigmoid_gate_(out, gate)
    return out * torch.sigmoid(gate.reshape(out.shape))


def kv_scales_summary(model: nn.Module) -> str:
    """For the start-up log of an FP8 KV cache: where the attention layers' k/v scales came from and their range."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    loaded = sum(m.kv_scales_loaded for m in layers)
    if not loaded:
        return f"the checkpoint ships no k_scale / v_scale: 1.0 for all {len(layers)} attention layers"
    scales = [s for m in layers for s in (m.k_scale, m.v_scale)]
    rest = f", 1.0 for the other {len(layers) - loaded}" if loaded < len(layers) else ""
    return (f"k_scale / v_scale from the checkpoint for {loaded} of {len(layers)} attention layers{rest} "
            f"(from {min(scales):.4g} to {max(scales):.4g})")


def overlap_with_o_projection(model: nn.Module) -> int:
    """Let decode attention launch the o projection at its start in the attention blocks (modules holding `attn`
    and `o_proj`) whose o projection's single-row GEMV loads all its rows before its wait
    (cuda_gemv.rows_preloaded): its weights then stream while attention runs. Returns how many blocks."""
    from shardserve.layers.cuda_gemv import rows_preloaded

    overlapped = 0
    for module in model.modules():
        attn, o_proj = getattr(module, "attn", None), getattr(module, "o_proj", None)
        if isinstance(attn, PagedAttention) and o_proj is not None:
            attn.launches_next_early = rows_preloaded(o_proj)
            overlapped += attn.launches_next_early
    return overlapped
