"""`shardserve plan`'s arithmetic for NemotronH (planner.py asks here for configs with model_type nemotron_h).

One rank's share, decided by the same functions that build the model (layers/sharding.py), so the plan is what a rank
holds: each Mamba-2 layer by whole B/C groups with their heads (or whole), attention by heads, the dense MLPs by
features, the mixtures of experts by features or, under expert parallelism, by whole experts (their routers, and
LatentMoE's latent projections, whole on every rank; the shared expert split where the experts are and its features
split), vocabulary-parallel embedding and LM head (NemotronH never ties them). The layers are read by ModelConfig,
as the engine reads them.

A sequence's fixed state per Mamba-2 layer: its convolution's last conv_kernel - 1 inputs over this rank's channels,
in the model's dtype, and each local head's head_dim x state_size SSM state, in --mamba-ssm-cache-dtype.
"""

from __future__ import annotations

from shardserve.config import ModelConfig, architecture_of
from shardserve.layers.sharding import attention_shard, expert_shard, mamba_shard, split_rows


def is_nemotron_h(cfg: dict) -> bool:
    return architecture_of(cfg) == "NemotronHForCausalLM"


def _model_config(cfg: dict) -> ModelConfig:
    return ModelConfig.from_hf_dict({**cfg, "architectures": ["NemotronHForCausalLM"]})


def _mamba_elements(m: ModelConfig, tp: int, replicated: list[str]) -> int:
    shard = mamba_shard(m.mamba_num_heads, m.mamba_n_groups, m.mamba_head_dim, 0, tp)
    if tp > 1 and not shard.sharded:
        replicated.append("mamba")
    heads, inner = shard.num_heads, shard.num_heads * m.mamba_head_dim
    channels = inner + 2 * shard.num_groups * m.mamba_state_size
    in_rows = inner + channels + heads  # z, x | B | C, dt
    total = m.hidden_size * in_rows + channels * m.mamba_conv_kernel + 3 * heads + inner + inner * m.hidden_size
    if m.mamba_conv_bias:
        total += channels
    if m.mamba_proj_bias:
        total += in_rows + m.hidden_size
    return total


def _attention_elements(m: ModelConfig, tp: int, replicated: list[str]) -> int:
    shard = attention_shard(m.num_heads, m.num_kv_heads, m.head_dim, 0, tp)
    if tp > 1 and not shard.sharded:
        replicated.append("attention")
    return m.hidden_size * (2 * shard.num_q + 2 * shard.num_kv) * m.head_dim


def _mlp_elements(m: ModelConfig, tp: int, replicated: list[str]) -> int:
    (r0, r1), sharded = split_rows(m.intermediate_size, 0, tp, "mlp")
    if tp > 1 and not sharded:
        replicated.append("mlp")
    rows = r1 - r0
    return 2 * m.hidden_size * rows + ((rows + m.hidden_size) if m.mlp_bias else 0)


def _moe_elements(m: ModelConfig, tp: int, replicated: list[str], expert_parallel: bool, active: bool) -> int:
    """One "moe" block on a rank: router and correction bias, its experts (or with `active`, the num_experts_per_tok
    a token reads, at this rank's features), the shared expert, the latent projections."""
    h, width = m.hidden_size, m.moe_latent_size or m.hidden_size
    shard = expert_shard(m.num_experts, m.moe_intermediate_size, 0, tp, expert_parallel)
    if tp > 1 and not shard.sharded:
        replicated.append("moe experts")
    held = shard.experts[1] - shard.experts[0]
    experts = min(m.num_experts_per_tok, held) if active else held
    total = m.num_experts * (h + 1) + experts * 2 * width * (shard.rows[1] - shard.rows[0])
    shared = m.shared_expert_intermediate_size
    (s0, s1), split = split_rows(shared, 0, tp, "shared expert") if shard.sharded else ((0, shared), False)
    if tp > 1 and not split:
        replicated.append("shared expert")
    total += 2 * h * (s1 - s0)
    return total + 2 * h * m.moe_latent_size


def layer_elements_per_rank(cfg: dict, tp: int, replicated: list[str], active: bool = False,
                            expert_parallel: bool = False) -> list[int]:
    """Each block's parameters on rank 0 of `tp` (its norm and mixer; with `active`, those one token reads); the
    blocks held whole on every rank are named in `replicated`."""
    m = _model_config(cfg)
    per_kind = {"linear_attention": lambda: _mamba_elements(m, tp, replicated),
                "full_attention": lambda: _attention_elements(m, tp, replicated),
                "mlp": lambda: _mlp_elements(m, tp, replicated),
                "moe": lambda: _moe_elements(m, tp, replicated, expert_parallel, active)}
    return [m.hidden_size + per_kind[kind]() for kind in m.layer_types]


def weight_elements_per_rank(cfg: dict, tp: int, replicated: list[str], active: bool = False,
                             expert_parallel: bool = False) -> int:
    """Parameters rank 0 of `tp` holds (with `active`, those one token reads); the blocks held whole on every rank
    are named in `replicated`."""
    m = _model_config(cfg)
    total = sum(layer_elements_per_rank(cfg, tp, replicated, active, expert_parallel))
    vocab_rows = -(-m.vocab_size // tp)
    return total + 2 * vocab_rows * m.hidden_size + m.hidden_size  # embedding, LM head, final norm


def attention_and_state_layers(cfg: dict) -> tuple[list[int], list[int]]:
    """(The attention layers, the Mamba-2 layers): those with a KV cache, those with a state a sequence."""
    m = _model_config(cfg)
    return list(m.kv_layers), list(m.linear_attention_layers)


def packed_elements_per_rank(cfg: dict, tp: int) -> tuple[int, int, int]:
    """(projection weights, expert weights, their rows) rank 0 of `tp` keeps packed under a quantized checkpoint:
    each Mamba-2 layer's in_proj and out_proj, attention's q/k/v/o, the dense MLPs' and the shared experts' up and
    down projections; and the routed experts' up and down weights (a down weight's rows are the hidden size on every
    rank). Routers and LatentMoE's latent projections stay in the compute dtype, and so do the modules the
    quantization_config leaves out (ModelOpt's exclude_modules: NVIDIA's NVFP4 checkpoints name their attention
    layers and the Mamba-2 layers before them)."""
    from shardserve.weight_format import parse_quantization

    m = _model_config(cfg)
    scheme = parse_quantization(cfg)

    def packed(i: int, name: str) -> bool:  # by the checkpoint's name of layer i's module
        return scheme is None or scheme.quantizes(f"backbone.layers.{i}.mixer.{name}")

    projections = experts = rows = 0
    for i, kind in enumerate(m.layer_types):
        if kind == "linear_attention":
            shard = mamba_shard(m.mamba_num_heads, m.mamba_n_groups, m.mamba_head_dim, 0, tp)
            inner = shard.num_heads * m.mamba_head_dim
            channels = inner + 2 * shard.num_groups * m.mamba_state_size
            if packed(i, "in_proj"):
                projections += m.hidden_size * (inner + channels + shard.num_heads)
                rows += inner + channels + shard.num_heads
            if packed(i, "out_proj"):
                projections += inner * m.hidden_size
                rows += m.hidden_size
        elif kind == "full_attention":
            shard = attention_shard(m.num_heads, m.num_kv_heads, m.head_dim, 0, tp)
            for name, heads in (("q_proj", shard.num_q), ("k_proj", shard.num_kv), ("v_proj", shard.num_kv)):
                if packed(i, name):
                    projections += m.hidden_size * heads * m.head_dim
                    rows += heads * m.head_dim
            if packed(i, "o_proj"):
                projections += shard.num_q * m.head_dim * m.hidden_size
                rows += m.hidden_size
        elif kind == "mlp":
            (r0, r1), _ = split_rows(m.intermediate_size, 0, tp, "mlp")
            for name, held_rows in (("up_proj", r1 - r0), ("down_proj", m.hidden_size)):
                if packed(i, name):
                    projections += m.hidden_size * (r1 - r0)
                    rows += held_rows
        elif kind == "moe":
            shard = expert_shard(m.num_experts, m.moe_intermediate_size, 0, tp, False)
            width = m.moe_latent_size or m.hidden_size
            held = shard.experts[1] - shard.experts[0]
            if packed(i, "experts.0.up_proj") and packed(i, "experts.0.down_proj"):
                experts += held * 2 * width * (shard.rows[1] - shard.rows[0])
                rows += held * (shard.rows[1] - shard.rows[0] + width)
            shared = m.shared_expert_intermediate_size
            (s0, s1), _ = split_rows(shared, 0, tp, "shared expert") if shard.sharded else ((0, shared), False)
            for name, held_rows in (("shared_experts.up_proj", s1 - s0), ("shared_experts.down_proj", m.hidden_size)):
                if packed(i, name):
                    projections += m.hidden_size * (s1 - s0)
                    rows += held_rows
    return projections, experts, rows


def kv_bytes_per_token(cfg: dict, tp: int, kv_bytes: int) -> int:
    """Keys and values of one token over the attention layers, on one rank."""
    m = _model_config(cfg)
    shard = attention_shard(m.num_heads, m.num_kv_heads, m.head_dim, 0, tp)
    return 2 * len(m.kv_layers) * shard.num_kv * m.head_dim * kv_bytes


def state_bytes_per_seq(cfg: dict, tp: int, conv_bytes: int, ssm_bytes: int) -> int:
    """One sequence's Mamba-2 states on one rank: conv inputs at conv_bytes an element, SSM states at ssm_bytes."""
    m = _model_config(cfg)
    shard = mamba_shard(m.mamba_num_heads, m.mamba_n_groups, m.mamba_head_dim, 0, tp)
    channels = shard.num_heads * m.mamba_head_dim + 2 * shard.num_groups * m.mamba_state_size
    per_layer = (channels * (m.mamba_conv_kernel - 1) * conv_bytes
                 + shard.num_heads * m.mamba_head_dim * m.mamba_state_size * ssm_bytes)
    return len(m.linear_attention_layers) * per_layer
