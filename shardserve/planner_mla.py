"""`shardserve plan`'s arithmetic for DeepSeek-V2 and V3's multi-head latent attention (planner.py asks here for
configs with a kv_lora_rank).

One rank's share of a latent attention block, decided by the function that builds it (layers/sharding.attention_shard,
as layers/mla.py calls it): q_proj or q_b_proj, kv_b_proj and o_proj by heads (or whole where the heads do not
split), q_a_proj, kv_a_proj_with_mqa and their norms whole on every rank. The latent cache holds kv_lora_rank +
qk_rope_head_dim elements a token a layer, replicated on every rank: tensor parallelism does not shrink it.
"""

from __future__ import annotations

from shardserve.config import routed_experts
from shardserve.layers.sharding import attention_shard

REPLICATED_NOTE = "the latent cache is replicated on every rank (each holds every token's latent)"


def is_latent_attention(cfg: dict) -> bool:
    return bool(cfg.get("kv_lora_rank"))


def attention_elements_per_rank(cfg: dict, tp: int, replicated: list[str]) -> int:
    """Parameters of one latent attention block on one rank."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora, latent, rope = cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    qk, v = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
    shard = attention_shard(heads, heads, qk, 0, tp, "latent attention")
    if tp > 1 and not shard.sharded:
        replicated.append("latent attention")
    local = shard.num_q
    bias = bool(cfg.get("attention_bias"))
    query = (h * q_lora + q_lora * bias + q_lora + q_lora * local * qk) if q_lora else h * local * qk
    kv = h * (latent + rope) + (latent + rope) * bias + latent + latent * local * (cfg["qk_nope_head_dim"] + v)
    return query + kv + local * v * h + h * bias


def kv_bytes_per_token(cfg: dict, kv_bytes: int) -> int:
    """The latent cache's bytes a token on each rank: one [latent | rope key] entry a layer."""
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * kv_bytes


def router_elements(cfg: dict) -> int:
    """A DeepSeek router's parameters beyond its weight: V3's score-correction bias (V2 has none)."""
    return routed_experts(cfg) if cfg.get("model_type") != "deepseek_v2" else 0

