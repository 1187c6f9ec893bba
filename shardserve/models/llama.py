"""The Llama family decoder (Llama 2/3, SmolLM2, Mistral), with the Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm) variants and their mixtures of experts (Mixtral, Qwen3-MoE: a sparse expert block in
place of the MLP in the layers the config names, layers/moe.py), written for tensor parallelism.

Attention is split by query heads and the MLP (and every expert) by intermediate features; each block falls
back to replication when its shapes don't split evenly (see layers/sharding.py).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.layers.attention import PagedAttention
from shardserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.layers.mlp import SwiGLUMLP
from shardserve.layers.moe import SparseMoE
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding, RotaryLookup
from shardserve.layers.sharding import attention_shard, split_rows

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        hd = cfg.head_dim
        shard = attention_shard(cfg.num_heads, cfg.num_kv_heads, hd, comm.rank, comm.world_size)
        self.shard = shard
        (q0, q1), (kv0, kv1) = shard.q_heads, shard.kv_heads
        self.q_size, self.kv_size = shard.num_q * hd, shard.num_kv * hd
        parts = {"q": (q0 * hd, q1 * hd), "k": (kv0 * hd, kv1 * hd), "v": (kv0 * hd, kv1 * hd)}
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, parts, cfg.qkv_bias, dtype)
        self.o_proj = RowParallelLinear((q0 * hd, q1 * hd), cfg.hidden_size, cfg.o_bias, dtype,
                                        comm if shard.sharded else None)
        self.qkv_proj.replicated = self.o_proj.replicated = not shard.sharded
        self.o_proj.defer()
        self.o_proj.preloads_rows = True  # its GEMV is placed during decode attention (kernels/triton/pdl.py)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.attn = PagedAttention(shard.num_q, shard.num_kv, hd, shard.kv_index)
        if cfg.qk_norm:
            self.attn.head_norm = (self.q_norm, self.k_norm)
        self.head_dim = hd

    def forward(self, rotary: RotaryLookup, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                cache: KVCache, meta, reduce=None, next_norm: RMSNorm | None = None):
        """Attention of norm(x + residual): (output, new residual x + residual, the output's pending reduction).
        With `reduce`, x is a partial sum to all-reduce first. Where o_proj reduced its output, added it to the
        residual and applied `next_norm` itself (RowParallelLinear.forward_add), the output is that norm's."""
        tokens = x.shape[0]
        qkv, residual = self.qkv_proj.forward_normed(x, residual, norm, reduce)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(tokens, -1, self.head_dim)  # query heads, then key heads
        # The attention backend normalises (Qwen3) and rotates query and key heads together and stores keys and
        # values in the cache.
        out = self.attn(qk, v.view(tokens, -1, self.head_dim), rotary, cache, meta)
        return self.o_proj.forward_add(out, residual, next_norm)


class MLP(SwiGLUMLP):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        rows, sharded = split_rows(cfg.intermediate_size, comm.rank, comm.world_size, "mlp")
        super().__init__(cfg.hidden_size, rows, cfg.mlp_bias, dtype, comm if sharded else None, not sharded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, reduce=None,
                next_norm: RMSNorm | None = None):
        """MLP of norm(x + residual): (output, new residual, pending reduction) as in Attention."""
        return self.forward_normed(x, residual, norm, reduce, next_norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, sparse: bool = False,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, comm, dtype)
        self.mlp = (SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                              cfg.renormalize_topk, comm, dtype, expert_parallel, cfg.shared_expert_intermediate_size)
                    if sparse else MLP(cfg, comm, dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, rotary: RotaryLookup, x, residual, cache: KVCache, meta, reduce=None,
                next_norm: RMSNorm | None = None):
        """x: the previous layer's output (the embeddings for the first layer, with residual None), a partial
        sum still to be all-reduced with `reduce` where the previous layer deferred its reduction, or already
        this layer's input norm's output where `reduce` is NORMED. Returns (output, residual, the output's pending
        reduction); `next_norm`: the norm after this layer (the next layer's first, or the model's last), which
        the layer's last projection may apply itself (RowParallelLinear.forward_add)."""
        x, residual, pending = self.self_attn(rotary, x, residual, self.input_layernorm, cache, meta, reduce,
                                              self.post_attention_layernorm)
        if isinstance(self.mlp, SparseMoE):
            x, residual = self.mlp(x, residual, self.post_attention_layernorm, pending)
            return x, residual, self.mlp.pending
        return self.mlp(x, residual, self.post_attention_layernorm, pending, next_norm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, comm)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, comm, dtype, i in cfg.moe_layers, expert_parallel)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, token_ids, positions, caches: list[KVCache], meta) -> torch.Tensor:
        x, residual, pending = self.embed_tokens(token_ids), None, None
        rotary = self.rotary.lookup(positions)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, cache, next_norm in zip(self.layers, caches, next_norms):
            # A layer's last all-reduce happens in its last projection's GEMV with the residual add and the next
            # norm (forward_add), or in the next layer's first norm (one kernel with the add).
            x, residual, pending = layer(rotary, x, residual, cache, meta, pending, next_norm)
        x, _ = self.norm(x, residual, reduce=pending)
        return x


# Expert blocks' tensors: Qwen3-MoE's mlp.experts.{e}.{gate,up,down}_proj and mlp.gate, Mixtral's
# block_sparse_moe.experts.{e}.{w1,w3,w2} and block_sparse_moe.gate, and the fused experts.gate_up_proj /
# experts.down_proj of newer checkpoints.
_EXPERT_TENSOR = re.compile(
    r"^(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\."
    r"(?:experts\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight"
    r"|experts\.(?P<fused>gate_up_proj|down_proj)|(?P<router>gate)\.weight)$")


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensors that are packed into one fused local parameter: name -> (fused name, shard id).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 expert_parallel: bool = False) -> None:
        """expert_parallel: a mixture of experts' experts divided among the ranks (whole experts) rather than
        each split by features."""
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, comm, dtype, max_positions, expert_parallel)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, cfg.tie_word_embeddings)

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

    def forward(self, token_ids, positions, caches: list[KVCache], meta) -> torch.Tensor:
        return self.model(token_ids, positions, caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on the first rank, None on the others."""
        return self.lm_head(hidden)

    def kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.shard.num_kv
