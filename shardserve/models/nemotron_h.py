"""NemotronH: a hybrid of Mamba-2 layers (a per-sequence state), a few attention layers and dense MLP layers.

Unlike Llama's decoder layers, each NemotronH layer is one block on the residual stream, x + mixer(norm(x)), whose
mixer is what ModelConfig.layer_types says: "linear_attention" a Mamba-2 mixer (layers/mamba2.py), "full_attention"
attention without RoPE (no bias, KV heads grouped), "mlp" up_proj -> squared ReLU -> down_proj, "moe" Nemotron-3's
mixture of experts (NemotronHMoE: grouped top-k routing, non-gated experts, a shared expert, LatentMoE's latent
projections). Only the attention layers hold KV-cache blocks; each Mamba-2 layer keeps one state per sequence in a
pool of slots that the engine hands out (state_pools). Every block all-reduces its own output where it is split
(row-parallel projections; the mixture of experts once at its end).

The multi-token-prediction layers of released checkpoints (`mtp.`) are left unread with one log line; NVIDIA's
remote-code checkpoints name the model `backbone.`, read as `model.`.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
from torch import nn

from shardserve.config import ModelConfig, PipelineStage
from shardserve.distributed.communicator import Communicator
from shardserve.layers.attention import PagedAttention
from shardserve.layers.grouped_topk import GroupedTopK, GroupedTopKRouter
from shardserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer, MambaState
from shardserve.layers.nongated_experts import NonGatedExperts
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding, RotaryLookup
from shardserve.layers.shared_slots import experts_with_shared, shared_slots
from shardserve.layers.sharding import attention_shard, expert_shard, split_rows
from shardserve.models.llama import NotOnThisStage, residual_stream
from shardserve.models.stages import last_stage_head, other_stages_prefixes, stage_embedding

# A "moe" layer's expert tensors (after `backbone.` is read as `model.`): one expert's, or all experts' stacked.
_EXPERT_TENSOR = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mixer\.experts\."
                            r"(?:(?P<expert>\d+)\.(?P<part>up_proj|down_proj)\.weight|(?P<stacked>up_proj|down_proj))$")

# The cache a Mamba-2 layer gets in a step: its pool of states, each chunk's slot in it (in the step's batch order)
# and where each chunk's rows start (None: one token each).
StateCache = tuple[MambaState, torch.Tensor, Sequence[int] | None]


class NoRotation(RotaryEmbedding):
    """Attention without positions in its queries and keys: the tables of the identity rotation (cos 1, sin 0),
    so every attention backend, and its start-up check, computes x * 1 + roll(x) * 0 = x exactly."""

    def __init__(self, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.register_buffer("cos", torch.ones(max_positions, head_dim, dtype=dtype), persistent=False)
        self.register_buffer("signed_sin", torch.zeros(max_positions, head_dim, dtype=dtype), persistent=False)


class NemotronHAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        hd = cfg.head_dim
        shard = attention_shard(cfg.num_heads, cfg.num_kv_heads, hd, comm.rank, comm.world_size)
        self.shard, self.head_dim = shard, hd
        (q0, q1), (kv0, kv1) = shard.q_heads, shard.kv_heads
        self.q_size, self.kv_size = shard.num_q * hd, shard.num_kv * hd
        parts = {"q": (q0 * hd, q1 * hd), "k": (kv0 * hd, kv1 * hd), "v": (kv0 * hd, kv1 * hd)}
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, parts, False, dtype)
        self.o_proj = RowParallelLinear((q0 * hd, q1 * hd), cfg.hidden_size, False, dtype,
                                        comm if shard.sharded else None)
        self.qkv_proj.replicated = self.o_proj.replicated = not shard.sharded
        self.attn = PagedAttention(shard.num_q, shard.num_kv, hd, shard.kv_index)

    def forward(self, h: torch.Tensor, rotary: RotaryLookup, cache, meta) -> torch.Tensor:
        return self._attended(self.qkv_proj(h), rotary, cache, meta)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm, rotary: RotaryLookup, cache,
                       meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(s)), s) with s = x + residual (x without one): the norm in qkv_proj's launches where its
        kernel has a norm-fused form (ColumnParallelLinear.forward_normed)."""
        qkv, residual = self.qkv_proj.forward_normed(x, residual, norm)
        return self._attended(qkv, rotary, cache, meta), residual

    def _attended(self, qkv: torch.Tensor, rotary: RotaryLookup, cache, meta) -> torch.Tensor:
        tokens = qkv.shape[0]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        out = self.attn(qk.view(tokens, -1, self.head_dim), v.view(tokens, -1, self.head_dim), rotary, cache, meta)
        return self.o_proj(out)


class NemotronHMLP(nn.Module):
    """down_proj(act(up_proj(h))), act the squared ReLU (relu2) or SiLU, over the features `rows` of up_proj (and
    the same columns of down_proj). With `comm` the layer all-reduces its output; without, the output is this rank's
    whole result, or its share of an enclosing block's sum (a mixture of experts' shared expert)."""

    def __init__(self, hidden_size: int, rows: tuple[int, int], bias: bool, activation: str, dtype: torch.dtype,
                 comm: Communicator | None, replicated: bool) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, {None: rows}, bias, dtype)
        self.down_proj = RowParallelLinear(rows, hidden_size, bias, dtype, comm)
        self.up_proj.replicated = self.down_proj.replicated = replicated
        self.squared_relu = activation == "relu2"

    @classmethod
    def dense(cls, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype) -> "NemotronHMLP":
        """An "mlp" layer's block: split by intermediate features where they split, else whole on every rank."""
        rows, sharded = split_rows(cfg.intermediate_size, comm.rank, comm.world_size, "mlp")
        return cls(cfg.hidden_size, rows, cfg.mlp_bias, cfg.mlp_activation, dtype, comm if sharded else None,
                   not sharded)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = self.up_proj(h)
        u = torch.relu(u).square() if self.squared_relu else nn.functional.silu(u)
        return self.down_proj(u)


class NemotronHMoE(nn.Module):
    """A "moe" layer's block, as transformers' NemotronHMoE: on the normed hidden states h,
    fc2_latent_proj(experts(fc1_latent_proj(h))) + shared_experts(h), where the router (layers/grouped_topk.py)
    chooses each token's experts on h, the routed experts are non-gated (layers/nongated_experts.py) and, under
    LatentMoE (moe_latent_size), work at the latent width between the two latent projections (without it those are
    the identity). The shared expert reads h itself, at the hidden width.

    Tensor parallel: the experts split by features, or whole experts per rank under expert parallelism, each rank's
    expert output a partial sum at the expert width; the shared expert split by features likewise (whole on every
    rank and added by rank 0 only where its features do not split). The latent projections are replicated: fc1's
    latent must be whole on every rank, since every expert feature reads all of it (splitting fc1 would cost an
    all-gather), and fc2 is linear, so fc2 of each rank's partial latent sum is its partial hidden sum; one
    all-reduce at the end of the block sums everything (fc2 without a bias: config.py refuses mlp_bias here). Where
    the experts do not split, everything is whole on every rank and nothing is reduced."""

    graph_unsafe_reason = NonGatedExperts.graph_unsafe_reason

    @property
    def graph_safe(self) -> bool:
        """Whether CUDA graphs capture the block: its experts run the fused kernel (no host synchronisation); the
        router, latent projections and shared expert never read the device."""
        return self.experts.graph_safe

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, expert_parallel: bool) -> None:
        super().__init__()
        h, latent = cfg.hidden_size, cfg.moe_latent_size
        shard = expert_shard(cfg.num_experts, cfg.moe_intermediate_size, comm.rank, comm.world_size, expert_parallel)
        route = GroupedTopK(cfg.num_experts, cfg.num_experts_per_tok, cfg.num_expert_groups, cfg.topk_expert_groups,
                            cfg.renormalize_topk, cfg.routed_scaling_factor)
        self.gate = GroupedTopKRouter(h, route)
        self.experts = NonGatedExperts(latent or h, cfg.moe_intermediate_size, cfg.num_experts,
                                       cfg.num_experts_per_tok, shard, cfg.mlp_activation, dtype)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent:
            self.fc1_latent_proj = ColumnParallelLinear(h, {None: (0, latent)}, False, dtype)
            self.fc2_latent_proj = ColumnParallelLinear(latent, {None: (0, h)}, False, dtype)
            self.fc1_latent_proj.replicated = self.fc2_latent_proj.replicated = True
        size = cfg.shared_expert_intermediate_size
        rows, split = split_rows(size, comm.rank, comm.world_size, "shared expert") if shard.sharded else ((0, size),
                                                                                                          False)
        self.shared_experts = NemotronHMLP(h, rows, False, cfg.mlp_activation, dtype, None, not split)
        # Each rank adds its share of the shared expert, or where it is whole while the block sums partial outputs,
        # rank 0 alone adds it (so it counts once in the sum).
        self.adds_shared_expert = split or not shard.sharded or comm.rank == 0
        # Only where every rank adds a share may the experts' kernels compute it (layers/shared_slots.py).
        self.shared_in_experts = (split or not shard.sharded) and not latent
        self.comm = comm if shard.sharded else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(h)
        mlp = self.shared_experts
        slots = shared_slots(self.experts, mlp.up_proj, mlp.down_proj, h) if self.shared_in_experts else None
        if slots is not None:  # one token: the shared expert as more choices of the experts' two launches
            out = experts_with_shared(self.experts, slots, h, weights, ids)
            return out if self.comm is None else self.comm.all_reduce(out)
        x = h if self.fc1_latent_proj is None else self.fc1_latent_proj(h)
        out = self.experts(x, weights, ids)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        if self.adds_shared_expert:
            out = out + self.shared_experts(h)
        return out if self.comm is None else self.comm.all_reduce(out)


class NemotronHBlock(nn.Module):
    """x + mixer(norm(x)) for one of NemotronH's block types."""

    def __init__(self, kind: str, mixer: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mixer = mixer

    def forward(self, rotary: RotaryLookup, x: torch.Tensor, residual: torch.Tensor | None, cache, meta):
        """x: the previous block's output (the embeddings, with residual None, for the first); returns (this
        block's output, the residual stream before it is added)."""
        # The state and attention mixers take the norm into their input projection's launches where its kernel
        # can (forward_normed); the others read the normed hidden state several times (router, experts, shared).
        if self.kind == "linear_attention":
            return self.mixer.forward_normed(x, residual, self.norm, *cache)
        if self.kind == "full_attention":
            return self.mixer.forward_normed(x, residual, self.norm, rotary, cache, meta)
        # The MoE's router and the MLP's up projection are products: launched at the norm's start (next_early).
        h, residual = self.norm.with_sum(x, residual, next_early=True)
        return self.mixer(h), residual


class NemotronHModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 expert_parallel: bool = False, stage: PipelineStage | None = None) -> None:
        """`stage`: the layers this rank holds (default: all of them), as LlamaModel's."""
        super().__init__()
        self.stage = stage = stage or PipelineStage.whole(cfg.num_layers)
        self.embeddings = stage_embedding(cfg, comm, dtype, stage)
        self.rotary = NoRotation(cfg.head_dim, max_positions, dtype)
        dims = Mamba2Dims(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size,
                          cfg.mamba_n_groups, cfg.mamba_conv_kernel, cfg.mamba_chunk_size, cfg.rms_norm_eps,
                          cfg.mamba_time_step_limit, cfg.mamba_conv_bias, cfg.mamba_proj_bias)
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            if not stage.holds(i):
                layers.append(NotOnThisStage())
                continue
            if kind == "linear_attention":
                mixer = Mamba2Mixer(dims, comm, dtype)
            elif kind == "full_attention":
                mixer = NemotronHAttention(cfg, comm, dtype)
            elif kind == "mlp":
                mixer = NemotronHMLP.dense(cfg, comm, dtype)
            elif kind == "moe":
                mixer = NemotronHMoE(cfg, comm, dtype, expert_parallel)
            else:
                raise ValueError(f"NemotronH layer type {kind!r} is not supported")
            layers.append(NemotronHBlock(kind, mixer, cfg, dtype))
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.is_last else None

    def forward(self, token_ids, positions, caches: list, meta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """caches: each held layer's, in layer order. `hidden`: on a stage after the first, the residual stream the
        stage before returned. Returns the final norm's output on the last stage, else the residual stream (the
        last block's output added to the stream before it) for the next stage."""
        x, residual = (self.embeddings(token_ids) if self.stage.is_first else hidden), None
        rotary = self.rotary.lookup(positions)
        for layer, cache in zip(self.layers[self.stage.first_layer:self.stage.end_layer], caches):
            x, residual = layer(rotary, x, residual, cache, meta)
        if not self.stage.is_last:
            return residual_stream(x, residual, None)
        x, _ = self.norm_f(x, residual)
        return x


class NemotronHForCausalLM(nn.Module):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    renamed_checkpoint_prefixes = {"backbone.": "model."}
    keeps_ssm_states = True  # its Mamba-2 layers' SSM state pools take --mamba-ssm-cache-dtype (state_pools)
    builds_in_stages = True  # a pipeline stage builds its own layers only (`stage`)
    skipped_checkpoint_prefixes = {"mtp.": "the multi-token-prediction layers (speculative decoding, not served)"}

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, max_positions: int,
                 expert_parallel: bool = False, stage: PipelineStage | None = None) -> None:
        """`stage`: the pipeline stage this rank builds (default: the whole model), as LlamaForCausalLM's."""
        super().__init__()
        self.config = cfg
        self.expert_parallel = expert_parallel
        self.model = NemotronHModel(cfg, comm, dtype, max_positions, expert_parallel, stage)
        stage = self.model.stage
        self.lm_head = last_stage_head(cfg, comm, dtype, stage, self.model.embeddings)
        # the checkpoint's tensors of what other stages hold are passed over when loading
        self.unused_checkpoint_prefixes = other_stages_prefixes(
            cfg, stage, None if self.model.embeddings is not None else "model.embeddings.", "model.norm_f.")

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, object] | None:
        """Where a "moe" layer's expert tensor goes: (parameter, shard id) for experts.{e}.up_proj.weight and
        experts.{e}.down_proj.weight (one expert's) or experts.up_proj and experts.down_proj (all stacked); None for
        every other tensor, whose name is its parameter's."""
        found = _EXPERT_TENSOR.match(name)
        if found is None:
            return None
        layer, expert, part, stacked = found.group("layer", "expert", "part", "stacked")
        weight = "w1" if (part or stacked) == "up_proj" else "w2"
        return f"{layer}.mixer.experts.{weight}", ("all" if stacked else (int(expert), None))

    def forward(self, token_ids, positions, caches: list, meta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """caches: one per layer this rank holds, in layer order: a KVCache for each attention layer, (pool, slots,
        query_start) for each Mamba-2 layer, None for an MLP or mixture-of-experts layer. `hidden`: a later pipeline
        stage's input (NemotronHModel.forward)."""
        return self.model(token_ids, positions, caches, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def held_kv_layers(self) -> list[int]:
        """The attention layers (of config.kv_layers) this rank's pipeline stage holds: its KV cache's layers."""
        return [i for i in self.config.kv_layers if self.model.stage.holds(i)]

    def paged_attention(self) -> PagedAttention:
        return self.model.layers[self.held_kv_layers()[0]].mixer.attn

    def kv_heads_per_rank(self) -> int:
        return self.model.layers[self.held_kv_layers()[0]].mixer.shard.num_kv

    def state_pools(self, num_slots: int, device: torch.device, ssm_dtype: torch.dtype | None = None) -> dict[int, Any]:
        """A pool of num_slots zero states for each Mamba-2 layer this rank holds (its pipeline stage's; its heads and
        groups), the SSM states in ssm_dtype (--mamba-ssm-cache-dtype; None: float32)."""
        return {i: self.model.layers[i].mixer.zero_state(batch=num_slots, device=device, ssm_dtype=ssm_dtype)
                for i in self.config.linear_attention_layers if self.model.stage.holds(i)}
