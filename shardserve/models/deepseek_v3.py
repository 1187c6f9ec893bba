"""DeepSeek-V3 and DeepSeek-V2: the Llama decoder with multi-head latent attention (layers/mla.py) over a paged latent
cache, dense SwiGLU MLPs in the first first_k_dense_replace layers, and from there mixtures of experts with grouped
routing and shared experts (DeepseekMoE).

V3 routes on sigmoid scores with a score-correction bias, groups worth their two best (noaux_tc); V2 on softmax
scores (greedy, or group_limited_greedy: groups worth their best), without a bias (layers/grouped_topk.py). V2's
rotation pairs neighbouring dims, V3's where rope_interleave says.

The multi-token-prediction layers of released V3 checkpoints (`model.layers.{num_hidden_layers}` and up) are left
unread with one log line.
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.attention.mla import MlaBackend
from shardserve.config import ModelConfig
from shardserve.distributed.communicator import NORMED, Communicator, reduced_first
from shardserve.config import CacheLayout
from shardserve.layers.grouped_topk import GroupedTopK, GroupedTopKRouter
from shardserve.layers.mla import MlaDims, MultiHeadLatentAttention
from shardserve.layers.mlp import SwiGLUMLP
from shardserve.layers.moe import SparseMoE
from shardserve.layers.sharding import split_rows
from shardserve.models.llama import LlamaDecoderLayer, LlamaMLP
from shardserve.models.mixtral import MixtralForCausalLM, SparseDecoderLayer


class DeepseekMoE(SparseMoE):
    """SparseMoE's routed experts (SwiGLU, split by features or whole per rank under expert parallelism, their
    loaders and products) with DeepSeek's router (GroupedTopKRouter: float32 weights, grouped top-k, weights times
    routed_scaling_factor) and ungated shared experts of shared_size features every token takes.

    The shared experts split by features where the block's output is a partial sum anyway and their size splits;
    otherwise they are whole on every rank and, while the block's output is a partial sum, only rank 0 adds them
    (once in the all-reduced sum). Checkpoint names: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` (V3),
    `mlp.experts.{e}.{gate,up,down}_proj.weight` or fused `mlp.experts.gate_up_proj`, `mlp.shared_experts.*`."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, expert_parallel: bool) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.renormalize_topk, comm, dtype, expert_parallel)
        route = GroupedTopK(cfg.num_experts, cfg.num_experts_per_tok, cfg.num_expert_groups, cfg.topk_expert_groups,
                            cfg.renormalize_topk, cfg.routed_scaling_factor, cfg.scoring_func)
        self.gate = GroupedTopKRouter(cfg.hidden_size, route, correction_bias=cfg.scoring_func == "sigmoid")
        self.shared_experts = None
        size = cfg.shared_expert_intermediate_size
        if size:
            rows, split = split_rows(size, comm.rank, comm.world_size, "shared experts") \
                if self.pending is not None else ((0, size), False)
            self.shared_experts = SwiGLUMLP(cfg.hidden_size, rows, False, dtype, None, not split)
            self.adds_shared_expert = split or self.pending is None or comm.rank == 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                reduce: Communicator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As SparseMoE.forward: (the block's output, a partial sum where `pending` is set; the new residual)."""
        x, residual, reduce = reduced_first(x, residual, norm, reduce)
        h, residual = (x, residual) if reduce is NORMED else norm(x, residual)
        weights, ids = self.gate(h)
        out = self.experts(h, weights, ids)
        if self.shared_experts is not None and self.adds_shared_expert:
            out = out + self.shared_experts(h)
        return out, residual


class DeepseekV3ForCausalLM(MixtralForCausalLM):
    # Only the MLPs' gate and up projections are fused; the attention's projections keep their checkpoint names.
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 expert_parallel: bool = False, stage=None) -> None:
        """stage: the pipeline stage this rank builds (LlamaForCausalLM's; default the whole model). Each stage
        keeps the latent cache of its own layers."""
        super().__init__(cfg, comm, dtype, max_positions, expert_parallel, stage)
        # Released V3 checkpoints carry the multi-token-prediction layer(s) after the last decoder layer (one in
        # DeepSeek-V3 and R1; up to four are recognised), each counted apart in the load's log.
        self.skipped_checkpoint_prefixes = {f"model.layers.{i}.": "the multi-token-prediction layers"
                                            for i in range(cfg.num_layers, cfg.num_layers + 4)}

    def make_layer(self, index: int, comm: Communicator, dtype) -> nn.Module:
        """Decoder layer `index`: latent attention, then a dense MLP or (ModelConfig.moe_layers) DeepseekMoE."""
        cfg = self.config
        attn = MultiHeadLatentAttention(MlaDims.of(cfg), comm, dtype)
        if index in cfg.moe_layers:
            return SparseDecoderLayer(attn, DeepseekMoE(cfg, comm, dtype, self.expert_parallel), cfg, dtype)
        return LlamaDecoderLayer(attn, LlamaMLP(cfg, comm, dtype), cfg, dtype)

    def cache_layout(self) -> CacheLayout:
        """One plane of one entry a token: [latent | rotated rope key], the same on every rank."""
        return CacheLayout(1, 1, self.config.kv_lora_rank + self.config.qk_rope_head_dim)

    def attention_backend(self, device: torch.device, block_size: int) -> MlaBackend:
        return MlaBackend.for_device(device, block_size)

    def latent_attention_layers(self) -> list[MultiHeadLatentAttention]:
        """The latent attention of every layer this rank's pipeline stage holds."""
        return [self.model.layers[i].self_attn for i in self.held_kv_layers()]

    def paged_attention(self):
        raise NotImplementedError("DeepSeek's latent attention has no PagedAttention: see attention_backend")

    def kv_heads_per_rank(self) -> int:
        return 1
