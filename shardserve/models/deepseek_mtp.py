"""DeepSeek-V3's multi-token-prediction (MTP) layer, as one model of one layer: what --speculative-config's method
"mtp" runs on rank 0 (engine/mtp.py).

A checkpoint with num_nextn_predict_layers 1 stores it after the decoder layers, as model.layers.{L} (L the target's
num_hidden_layers): enorm and hnorm (RMSNorms), eh_proj (2H -> H, no bias), a decoder layer of the target's kind
(latent attention; a DeepseekMoE where L is a sparse layer, else a dense MLP), shared_head.norm and shared_head.head
(its own LM head). For the row of position i, whose next token t_{i+1} is known, and h_i, the target's last hidden
state at i before its final norm:

    x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]),  out = layer(x) at position i (its own latent cache),
    logits = shared_head.head(shared_head.norm(out))

whose argmax proposes t_{i+2}; the row of position 0 takes a zero embedding, as vLLM's DeepSeekMTP masks it. `out`
(before shared_head.norm) serves as h for the layer's next application (the proposals after the first). The checkpoint's model.layers.{L}. is read as mtp.; the target's embedding
(model.embed_tokens) is the one used, a copy under the layer (mtp.embed_tokens) left unread; everything else in the
checkpoint is the target's and unread here.
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.layers.linear import ColumnParallelLinear
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding
from shardserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from shardserve.models.llama import residual_stream
from shardserve.models.mixtral import MixtralForCausalLM

PREFIX = "mtp."  # the layer's parameters; the checkpoint's model.layers.{L}. is read as this


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head = ParallelLMHead(VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, comm), False)


class DeepseekMTP(nn.Module):
    """cfg: the target's ModelConfig with architecture "DeepseekMTP" and num_layers 1 (its latent cache holds the one
    layer), num_nextn_predict_layers keeping L, the checkpoint index of the MTP layer (engine/mtp.mtp_model_config).
    Called as the other models are, with the target's hidden states as `hidden` (one a row)."""

    packed_modules = DeepseekV3ForCausalLM.packed_modules

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.expert_parallel = expert_parallel
        index = cfg.num_nextn_predict_layers
        self.renamed_checkpoint_prefixes = {f"model.layers.{index}.": PREFIX, "model.embed_tokens.": "embed_tokens."}
        self.unused_checkpoint_prefixes = ("model.layers.", "model.norm.", "lm_head.", f"{PREFIX}embed_tokens.")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, comm)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        # The decoder layer of the target's kind (DeepseekV3ForCausalLM.make_layer reads only config and experts).
        self.mtp = DeepseekV3ForCausalLM.make_layer(self, 0, comm, dtype)
        self.mtp.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mtp.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mtp.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, {None: (0, cfg.hidden_size)}, False, dtype)
        self.mtp.eh_proj.replicated = True
        self.mtp.shared_head = SharedHead(cfg, comm, dtype)

    def forward(self, token_ids, positions, caches: list, meta, hidden: torch.Tensor, keep_stream: bool = False):
        """token_ids: t_{i+1} of each row, `hidden`: h_i, the rows at positions i. Returns shared_head.norm's
        output, or with keep_stream (that output, the hidden states it normed: the next application's h)."""
        layer = self.mtp
        embedded = self.embed_tokens(token_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        x = layer.eh_proj(torch.cat((layer.enorm(embedded), layer.hnorm(hidden)), dim=-1))
        x, residual, pending = layer(self.rotary.lookup(positions), x, None, caches[0], meta, None,
                                     layer.shared_head.norm)
        stream = residual_stream(x, residual, pending)
        out = layer.shared_head.norm(stream)
        return (out, stream) if keep_stream else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.shared_head.head(hidden)

    def checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """An expert tensor of the layer's DeepseekMoE: where MixtralForCausalLM.checkpoint_name puts a decoder
        layer's, under mtp."""
        if not name.startswith(PREFIX):
            return None
        found = MixtralForCausalLM.checkpoint_name("model.layers.0." + name.removeprefix(PREFIX))
        return None if found is None else (PREFIX + found[0].removeprefix("model.layers.0."), found[1])

    # What the engine reads of a model with a latent cache (DeepseekV3ForCausalLM's).
    cache_layout = DeepseekV3ForCausalLM.cache_layout
    attention_backend = DeepseekV3ForCausalLM.attention_backend

    def latent_attention_layers(self) -> list:
        return [self.mtp.self_attn]

    def held_kv_layers(self) -> list[int]:
        return [0]

    def kv_heads_per_rank(self) -> int:
        return 1

    def state_pools(self, num_slots: int, device: torch.device) -> dict:
        return {}
