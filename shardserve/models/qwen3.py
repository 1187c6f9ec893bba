"""Qwen3 and Qwen3-MoE: Llama's decoder (and Mixtral's sparse layers) with an RMSNorm over each query and each key
head before the rotation."""

from __future__ import annotations

import torch

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.layers.norm import RMSNorm
from shardserve.models.llama import LlamaAttention, LlamaForCausalLM
from shardserve.models.mixtral import MixtralForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__(cfg, comm, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.zero_centred_norm)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.zero_centred_norm)
        # Applied by the attention backend, inside its rotary kernel where it can (layers/attention.py).
        self.attn.head_norm = (self.q_norm, self.k_norm)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention = Qwen3Attention


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    attention = Qwen3Attention
