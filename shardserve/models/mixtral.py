"""Mixtral: the Llama decoder with a sparse mixture-of-experts block (layers/moe.py) in place of the MLP in the layers
ModelConfig.moe_layers names (every layer). Qwen2-MoE is the same network given its config: q/k/v biases, a
shared expert in every sparse block, dense MLPs in the layers its mlp_only_layers and decoder_sparse_step leave
out. Qwen3-MoE takes these layers with Qwen3's attention (models/qwen3.py).
"""

from __future__ import annotations

import re

from torch import nn

from shardserve.distributed.communicator import Communicator
from shardserve.layers.moe import SparseMoE
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryLookup
from shardserve.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM

# Expert blocks' tensors: Qwen-MoE's mlp.experts.{e}.{gate,up,down}_proj and mlp.gate (also what GGUF files of
# every family give), Mixtral's block_sparse_moe.experts.{e}.{w1,w3,w2} and block_sparse_moe.gate, and the fused
# experts.gate_up_proj / experts.down_proj of newer checkpoints.
_EXPERT_TENSOR = re.compile(
    r"^(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\."
    r"(?:experts\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight"
    r"|experts\.(?P<fused>gate_up_proj|down_proj)|(?P<router>gate)\.weight)$")


class SparseDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose feed-forward block `mlp` is a SparseMoE."""

    def forward(self, rotary: RotaryLookup, x, residual, cache: KVCache, meta, reduce=None,
                next_norm: RMSNorm | None = None):
        """As LlamaDecoderLayer.forward; the experts' output is a partial sum where the block is sharded, left for
        the next norm to all-reduce (`next_norm` is not applied here)."""
        x, residual, pending = self.self_attn(rotary, x, residual, self.input_layernorm, cache, meta, reduce,
                                              self.post_attention_layernorm)
        x, residual = self.mlp(x, residual, self.post_attention_layernorm, pending)
        return x, residual, self.mlp.pending


class MixtralForCausalLM(LlamaForCausalLM):
    def make_layer(self, index: int, comm: Communicator, dtype) -> nn.Module:
        """Decoder layer `index`: sparse where ModelConfig.moe_layers says, else Llama's dense one."""
        cfg = self.config
        if index not in cfg.moe_layers:
            return super().make_layer(index, comm, dtype)
        return SparseDecoderLayer(self.attention(cfg, comm, dtype), self.experts(comm, dtype), cfg, dtype)

    def experts(self, comm: Communicator, dtype) -> SparseMoE:
        """A sparse layer's expert block."""
        cfg = self.config
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.renormalize_topk, comm, dtype, self.expert_parallel, cfg.shared_expert_intermediate_size)

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, object] | None:
        """Where an expert block's checkpoint tensor goes: (parameter, shard id), or None for every other
        tensor (packed_modules then applies)."""
        found = _EXPERT_TENSOR.match(name)
        if found is None:
            return None
        layer, expert, part, fused = found.group("layer", "expert", "part", "fused")
        if found.group("router"):
            return f"{layer}.mlp.gate.weight", None
        if fused is not None:
            return f"{layer}.mlp.{'w13' if fused == 'gate_up_proj' else 'w2'}", "all"
        if part in ("down_proj", "w2"):
            return f"{layer}.mlp.w2", (int(expert), None)
        return f"{layer}.mlp.w13", (int(expert), 0 if part in ("gate_proj", "w1") else 1)
