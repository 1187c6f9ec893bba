"""The Llama decoder (Llama 2/3, SmolLM2, Mistral, and Qwen2, whose q/k/v biases ModelConfig.qkv_bias gives),
written for tensor parallelism, and the pieces the other families build on: the attention and MLP blocks, the
pre-norm decoder layer, the stack of layers, the causal LM around it.

Attention is split by query heads and the MLP by intermediate features; each block falls back to replication when
its shapes don't split evenly (see layers/sharding.py).

A family that differs subclasses LlamaForCausalLM in a module of its own and replaces `attention` (Qwen3's block
norms its heads, models/qwen3.py) or `make_layer` (sparse expert blocks, models/mixtral.py; a hybrid model's other
kinds of layer). Any layer LlamaModel chains keeps its call: forward(rotary, x, residual, cache, meta, reduce,
next_norm) -> (output, residual, pending reduction), with the norm over its input held as `input_layernorm`.

Under pipeline parallelism (a PipelineStage) a model holds its stage's layers only: the others are parameterless
placeholders, the embedding sits on the first stage and the final norm and head on the last, and a stage hands the
next one the residual stream (every pending reduction done) in place of the embeddings.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardserve.config import ModelConfig, PipelineStage
from shardserve.distributed.communicator import NORMED
from shardserve.distributed.communicator import Communicator
from shardserve.layers.attention import PagedAttention
from shardserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.layers.mlp import SwiGLUMLP
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding, RotaryLookup
from shardserve.layers.sharding import attention_shard, split_rows
from shardserve.models.stages import last_stage_head, other_stages_prefixes, stage_embedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        hd = cfg.head_dim
        shard = attention_shard(cfg.num_heads, cfg.num_kv_heads, hd, comm.rank, comm.world_size)
        self.shard = shard
        (q0, q1), (kv0, kv1) = shard.q_heads, shard.kv_heads
        self.q_size, self.kv_size = shard.num_q * hd, shard.num_kv * hd
        # With an output gate (Qwen3-Next) q_proj gives each query head's rows, then its gate's: twice the rows.
        self.gated = cfg.attn_output_gate
        q_rows = 2 * hd if self.gated else hd
        parts = {"q": (q0 * q_rows, q1 * q_rows), "k": (kv0 * hd, kv1 * hd), "v": (kv0 * hd, kv1 * hd)}
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, parts, cfg.qkv_bias, dtype)
        self.o_proj = RowParallelLinear((q0 * hd, q1 * hd), cfg.hidden_size, cfg.o_bias, dtype,
                                        comm if shard.sharded else None)
        self.qkv_proj.replicated = self.o_proj.replicated = not shard.sharded
        self.o_proj.defer()
        self.o_proj.preloads_rows = True  # its GEMV is placed during decode attention (kernels/triton/pdl.py)
        self.attn = PagedAttention(shard.num_q, shard.num_kv, hd, shard.kv_index)
        self.head_dim = hd

    def forward(self, rotary: RotaryLookup, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                cache: KVCache, meta, reduce=None, next_norm: RMSNorm | None = None):
        """Attention of norm(x + residual): (output, new residual x + residual, the output's pending reduction).
        With `reduce`, x is a partial sum to all-reduce first. Where o_proj reduced its output, added it to the
        residual and applied `next_norm` itself (RowParallelLinear.forward_add), the output is that norm's."""
        tokens = x.shape[0]
        qkv, residual = self.qkv_proj.forward_normed(x, residual, norm, reduce)
        # The attention backend normalises the heads where the block has head norms (Qwen3), rotates query and
        # key heads together and stores keys and values in the cache.
        if self.gated:  # each query head's rows are followed by its gate's: the query heads are a strided view
            q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, gate = q_gate.view(tokens, -1, 2, self.head_dim).unbind(2)
            out = self.attn.forward_apart(q, k.view(tokens, -1, self.head_dim), v.view(tokens, -1, self.head_dim),
                                          rotary, cache, meta, gate)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(tokens, -1, self.head_dim)  # query heads, then key heads
            out = self.attn(qk, v.view(tokens, -1, self.head_dim), rotary, cache, meta)
        return self.o_proj.forward_add(out, residual, next_norm)


class LlamaMLP(SwiGLUMLP):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        rows, sharded = split_rows(cfg.intermediate_size, comm.rank, comm.world_size, "mlp")
        super().__init__(cfg.hidden_size, rows, cfg.mlp_bias, dtype, comm if sharded else None, not sharded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, reduce=None,
                next_norm: RMSNorm | None = None):
        """MLP of norm(x + residual): (output, new residual, pending reduction) as in LlamaAttention."""
        return self.forward_normed(x, residual, norm, reduce, next_norm)


class LlamaDecoderLayer(nn.Module):
    """Attention, then the feed-forward block `mlp` (a LlamaMLP here), each on the normed residual stream."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.zero_centred_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.zero_centred_norm)

    def forward(self, rotary: RotaryLookup, x, residual, cache: KVCache, meta, reduce=None,
                next_norm: RMSNorm | None = None):
        """x: the previous layer's output (the embeddings for the first layer, with residual None), a partial
        sum still to be all-reduced with `reduce` where the previous layer deferred its reduction, or already
        this layer's input norm's output where `reduce` is NORMED. Returns (output, residual, the output's pending
        reduction); `next_norm`: the norm after this layer (the next layer's first, or the model's last), which
        the layer's last projection may apply itself (RowParallelLinear.forward_add)."""
        x, residual, pending = self.self_attn(rotary, x, residual, self.input_layernorm, cache, meta, reduce,
                                              self.post_attention_layernorm)
        return self.mlp(x, residual, self.post_attention_layernorm, pending, next_norm)


class NotOnThisStage(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no parameters, never called."""


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 make_layer: Callable[[int], nn.Module], stage: PipelineStage | None = None) -> None:
        """make_layer(i): decoder layer i. `stage`: the layers this rank holds (default: all of them)."""
        super().__init__()
        self.stage = stage = stage or PipelineStage.whole(cfg.num_layers)
        self.embed_tokens = stage_embedding(cfg, comm, dtype, stage)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(make_layer(i) if stage.holds(i) else NotOnThisStage()
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.zero_centred_norm) if stage.is_last else None

    def forward(self, token_ids, positions, caches: list, meta, hidden: torch.Tensor | None = None,
                keep_stream: bool = False):
        """caches: each held layer's, in layer order (a KVCache for attention; see the layer for others).
        `hidden`: on a stage after the first, the residual stream the previous stage returned (token_ids unused).
        Returns the final norm's output on the last stage, else the residual stream for the next stage;
        keep_stream: (the final norm's output, the residual stream it normed), for an MTP layer (engine/mtp.py)."""
        x = self.embed_tokens(token_ids) if self.stage.is_first else hidden
        residual, pending = None, None
        rotary = self.rotary.lookup(positions)
        held = self.layers[self.stage.first_layer:self.stage.end_layer]
        next_norms = [layer.input_layernorm for layer in held[1:]] + [self.norm]
        for layer, cache, next_norm in zip(held, caches, next_norms):
            # A layer's last all-reduce happens in its last projection's GEMV with the residual add and the next
            # norm (forward_add), or in the next layer's first norm (one kernel with the add).
            x, residual, pending = layer(rotary, x, residual, cache, meta, pending, next_norm)
        if not self.stage.is_last:
            return residual_stream(x, residual, pending)
        x, stream = self.norm(x, residual, reduce=pending)
        return (x, stream) if keep_stream else x


def residual_stream(x: torch.Tensor, residual: torch.Tensor | None, pending) -> torch.Tensor:
    """x + residual after a layer, its pending reduction done: what the next stage's first layer takes as its input
    (as the first layer takes the embeddings)."""
    if pending is NORMED:
        return residual  # x is already the next norm's output of the sum, which residual holds
    if pending is not None:
        x = pending.all_reduce(x)
    return x if residual is None else x + residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensors that are packed into one fused local parameter: name -> (fused name, shard id).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    attention: type[nn.Module] = LlamaAttention  # every layer's attention block
    builds_in_stages = True  # a pipeline stage builds its own layers only (`stage`)

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 expert_parallel: bool = False, stage: PipelineStage | None = None) -> None:
        """expert_parallel: a mixture of experts' experts divided among the ranks (whole experts) rather than
        each split by features (a dense model has none). `stage`: the pipeline stage this rank builds (default:
        the whole model)."""
        super().__init__()
        self.config = cfg
        self.expert_parallel = expert_parallel
        self.model = LlamaModel(cfg, comm, dtype, max_positions, lambda i: self.make_layer(i, comm, dtype), stage)
        stage = self.model.stage
        self.lm_head = last_stage_head(cfg, comm, dtype, stage, self.model.embed_tokens)
        if stage.count > 1:  # the checkpoint's tensors of what other stages hold are passed over when loading
            self.unused_checkpoint_prefixes = tuple(getattr(self, "unused_checkpoint_prefixes", ())) + \
                other_stages_prefixes(cfg, stage, None if self.model.embed_tokens is not None else
                                      "model.embed_tokens.", "model.norm.")

    def make_layer(self, index: int, comm: Communicator, dtype: torch.dtype) -> nn.Module:
        """Decoder layer `index`: attention and a dense MLP."""
        cfg = self.config
        return LlamaDecoderLayer(self.attention(cfg, comm, dtype), LlamaMLP(cfg, comm, dtype), cfg, dtype)

    def forward(self, token_ids, positions, caches: list, meta, hidden: torch.Tensor | None = None,
                keep_stream: bool = False):
        """caches: one per layer this rank holds, in layer order: a KVCache for each of config.kv_layers, and for a
        hybrid model's other layers what state_pools gave them with the step's slots (models/qwen3_next.py).
        `hidden`: a later pipeline stage's input, the residual stream from the stage before (LlamaModel.forward).
        keep_stream: also return the last hidden states before the final norm (LlamaModel.forward)."""
        if keep_stream:
            return self.model(token_ids, positions, caches, meta, hidden, keep_stream=True)
        if hidden is None:
            return self.model(token_ids, positions, caches, meta)
        return self.model(token_ids, positions, caches, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on the first rank, None on the others."""
        return self.lm_head(hidden)

    def held_kv_layers(self) -> list[int]:
        """The KV layers (of config.kv_layers) this rank's pipeline stage holds: its KV cache's layers."""
        return [i for i in self.config.kv_layers if self.model.stage.holds(i)]

    def paged_attention(self) -> PagedAttention:
        """The first held attention layer's PagedAttention: the head layout every KV layer shares."""
        return self.model.layers[self.held_kv_layers()[0]].self_attn.attn

    def kv_heads_per_rank(self) -> int:
        return self.model.layers[self.held_kv_layers()[0]].self_attn.shard.num_kv

    def state_pools(self, num_slots: int, device: torch.device) -> dict[int, Any]:
        """Per-sequence state pools (layer index -> pool of num_slots states) of the layers without a KV cache;
        none for a model whose every layer is attention."""
        return {}
