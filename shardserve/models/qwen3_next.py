"""Qwen3-Next: a hybrid of Gated DeltaNet layers (linear attention with a per-sequence state) and attention layers,
each followed by Qwen3-MoE's sparse block with a gated shared expert (or a dense MLP where mlp_only_layers and
decoder_sparse_step say).

ModelConfig.layer_types says which layers are which. The attention layers are Qwen3's, with RoPE over the first
partial_rotary_factor of each head and a sigmoid gate on the output (LlamaAttention with attn_output_gate); every
RMSNorm scales by 1 + w (RMSNorm with offset). Only the attention layers hold KV-cache blocks; each Gated DeltaNet
layer keeps one state per sequence in a pool of slots that the engine hands out (state_pools).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import NORMED, Communicator, reduced_first
from shardserve.layers.gated_deltanet import DeltaNetDims, DeltaNetState, GatedDeltaNet
from shardserve.layers.moe import SparseMoE
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryLookup
from shardserve.models.llama import LlamaMLP
from shardserve.models.qwen3 import Qwen3MoeForCausalLM

# The cache a Gated DeltaNet layer gets in a step: its pool of states, each chunk's slot in it (in the step's
# batch order) and where each chunk's rows start (query_start[i] to query_start[i + 1]).
StateCache = tuple[DeltaNetState, torch.Tensor, Sequence[int]]


class DeltaNetDecoderLayer(nn.Module):
    """A Gated DeltaNet layer, then the feed-forward block `mlp` (dense or sparse), each on the normed residual
    stream; called as LlamaDecoderLayer is, with a StateCache for its cache."""

    def __init__(self, linear_attn: GatedDeltaNet, mlp: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_attn = linear_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.zero_centred_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.zero_centred_norm)

    def forward(self, rotary: RotaryLookup, x, residual, cache: StateCache, meta, reduce=None,
                next_norm: RMSNorm | None = None):
        """As LlamaDecoderLayer.forward; rotary and meta are the attention layers' and unused here."""
        x, residual, reduce = reduced_first(x, residual, self.input_layernorm, reduce)
        if reduce is NORMED:
            h = x
        else:
            # in_proj_qkvz comes next: launched at the norm's start (next_early).
            h, residual = self.input_layernorm.with_sum(x, residual, next_early=True)
        pool, slots, query_start = cache
        x = self.linear_attn(h, pool, slots, query_start)  # out_proj has all-reduced it
        if isinstance(self.mlp, SparseMoE):
            x, residual = self.mlp(x, residual, self.post_attention_layernorm, None)
            return x, residual, self.mlp.pending
        return self.mlp(x, residual, self.post_attention_layernorm, None, next_norm)


class Qwen3NextForCausalLM(Qwen3MoeForCausalLM):
    packed_modules = {**Qwen3MoeForCausalLM.packed_modules, **GatedDeltaNet.packed_modules}
    # The multi-token-prediction layer of released checkpoints (speculative decoding, not served): left unread.
    unused_checkpoint_prefixes = ("mtp.",)

    def make_layer(self, index: int, comm: Communicator, dtype) -> nn.Module:
        """Decoder layer `index`: Gated DeltaNet where layer_types says, else Qwen3-MoE's attention layer; the
        feed-forward block sparse where ModelConfig.moe_layers says."""
        cfg = self.config
        if index not in cfg.linear_attention_layers:
            return super().make_layer(index, comm, dtype)
        dims = DeltaNetDims(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                            cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                            cfg.rms_norm_eps)
        mlp = self.experts(comm, dtype) if index in cfg.moe_layers else LlamaMLP(cfg, comm, dtype)
        return DeltaNetDecoderLayer(GatedDeltaNet(dims, comm, dtype), mlp, cfg, dtype)

    def state_pools(self, num_slots: int, device: torch.device) -> dict[int, DeltaNetState]:
        """A pool of num_slots zero states for each Gated DeltaNet layer this rank holds (its pipeline stage's; its
        value heads)."""
        return {i: self.model.layers[i].linear_attn.zero_state(batch=num_slots, device=device)
                for i in self.config.linear_attention_layers if self.model.stage.holds(i)}
