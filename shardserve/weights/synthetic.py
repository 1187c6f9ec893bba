"""Synthetic weights in a model's real shapes, for benchmarks where only config.json is at hand.

`iter_synthetic_checkpoint` yields every tensor a Hugging Face Llama/Qwen2/Qwen3 (or Mixtral/Qwen3-MoE, with
their experts in the fused layout; or NemotronH, its experts stacked as transformers holds them) checkpoint of the
config would hold, under the same names and with the full (unsharded) shapes, so they go through the
same per-parameter weight loaders as a real checkpoint and each rank keeps only its own slices.

Invariants:
- A tensor's values depend only on (seed, its name, its shape) and the device kind: every rank, at
  every tensor-parallel size, sees identical full tensors, so sharded runs compute the same model
  as unsharded ones. Values are drawn in float32 and then cast, so `dtype` changes only precision.
- One tensor exists at a time (besides what the model keeps): an 8B model never needs the whole
  checkpoint in memory twice.

Values follow Hugging Face's initialisation: matrices and biases normal with std 0.02 (its
initializer_range), norm weights 1 plus the same noise.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch

from shardserve.config import ModelConfig

STD = 0.02


def synthetic_checkpoint_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every tensor of a Hugging Face checkpoint with this config, in order."""
    if cfg.architecture == "NemotronHForCausalLM":
        yield from _nemotron_h_shapes(cfg)
        return
    h, inter = cfg.hidden_size, cfg.intermediate_size
    yield "model.embed_tokens.weight", (cfg.vocab_size, h)
    linear = set(cfg.linear_attention_layers)
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        if i in linear:
            yield from _linear_attention_shapes(cfg, f"model.layers.{i}.linear_attn")
        elif cfg.latent_attention:
            yield from _latent_attention_shapes(cfg, attn)
        else:
            yield from _attention_shapes(cfg, attn)
        if i in cfg.moe_layers:  # the router, then the experts stacked (the fused layout: one tensor each)
            e, moe_inter = cfg.num_experts, cfg.moe_intermediate_size
            yield f"{mlp}.gate.weight", (e, h)
            if cfg.latent_attention and cfg.scoring_func == "sigmoid":  # DeepSeek-V3's router
                yield f"{mlp}.gate.e_score_correction_bias", (e,)
            yield f"{mlp}.experts.gate_up_proj", (e, 2 * moe_inter, h)
            yield f"{mlp}.experts.down_proj", (e, h, moe_inter)
            if cfg.shared_expert_intermediate_size and cfg.latent_attention:  # DeepSeek's: ungated
                shared = cfg.shared_expert_intermediate_size
                yield f"{mlp}.shared_experts.gate_proj.weight", (shared, h)
                yield f"{mlp}.shared_experts.up_proj.weight", (shared, h)
                yield f"{mlp}.shared_experts.down_proj.weight", (h, shared)
            elif cfg.shared_expert_intermediate_size:
                shared = cfg.shared_expert_intermediate_size
                yield f"{mlp}.shared_expert.gate_proj.weight", (shared, h)
                yield f"{mlp}.shared_expert.up_proj.weight", (shared, h)
                yield f"{mlp}.shared_expert.down_proj.weight", (h, shared)
                yield f"{mlp}.shared_expert_gate.weight", (1, h)
            yield f"model.layers.{i}.input_layernorm.weight", (h,)
            yield f"model.layers.{i}.post_attention_layernorm.weight", (h,)
            continue
        for proj in ("gate_proj", "up_proj"):
            yield f"{mlp}.{proj}.weight", (inter, h)
            if cfg.mlp_bias:
                yield f"{mlp}.{proj}.bias", (inter,)
        yield f"{mlp}.down_proj.weight", (h, inter)
        if cfg.mlp_bias:
            yield f"{mlp}.down_proj.bias", (h,)
        yield f"model.layers.{i}.input_layernorm.weight", (h,)
        yield f"model.layers.{i}.post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, h)


def _nemotron_h_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A NemotronH checkpoint's tensors (under the model's names: its checkpoints' `backbone.` read as `model.`):
    one block per layer, `norm` and a `mixer` of the layer's type."""
    h = cfg.hidden_size
    yield "model.embeddings.weight", (cfg.vocab_size, h)
    heads, hd, n, groups = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size, cfg.mamba_n_groups
    inner, conv = heads * hd, heads * hd + 2 * groups * n
    for i, kind in enumerate(cfg.layer_types):
        mixer = f"model.layers.{i}.mixer"
        yield f"model.layers.{i}.norm.weight", (h,)
        if kind == "linear_attention":
            yield f"{mixer}.in_proj.weight", (inner + conv + heads, h)
            if cfg.mamba_proj_bias:
                yield f"{mixer}.in_proj.bias", (inner + conv + heads,)
            yield f"{mixer}.conv1d.weight", (conv, 1, cfg.mamba_conv_kernel)
            if cfg.mamba_conv_bias:
                yield f"{mixer}.conv1d.bias", (conv,)
            for vector in ("A_log", "D", "dt_bias"):
                yield f"{mixer}.{vector}", (heads,)
            yield f"{mixer}.norm.weight", (inner,)
            yield f"{mixer}.out_proj.weight", (h, inner)
            if cfg.mamba_proj_bias:
                yield f"{mixer}.out_proj.bias", (h,)
        elif kind == "full_attention":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield f"{mixer}.{proj}.weight", (rows, h)
            yield f"{mixer}.o_proj.weight", (h, q)
        elif kind == "moe":
            yield from _nemotron_h_moe_shapes(cfg, mixer)
        else:
            yield f"{mixer}.up_proj.weight", (cfg.intermediate_size, h)
            yield f"{mixer}.down_proj.weight", (h, cfg.intermediate_size)
            if cfg.mlp_bias:
                yield f"{mixer}.up_proj.bias", (cfg.intermediate_size,)
                yield f"{mixer}.down_proj.bias", (h,)
    yield "model.norm_f.weight", (h,)
    yield "lm_head.weight", (cfg.vocab_size, h)


def _nemotron_h_moe_shapes(cfg: ModelConfig, mixer: str, per_expert: bool = False
                           ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A NemotronH "moe" block's tensors: the router and its correction bias, the experts (stacked, as transformers
    holds them, or with `per_expert` one by one, as its checkpoints store them) at the latent width where there is
    one, the shared expert, and the latent projections."""
    h, inter, shared, latent = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                                cfg.moe_latent_size)
    width = latent or h
    yield f"{mixer}.gate.weight", (cfg.num_experts, h)
    yield f"{mixer}.gate.e_score_correction_bias", (cfg.num_experts,)
    if per_expert:
        for e in range(cfg.num_experts):
            yield f"{mixer}.experts.{e}.up_proj.weight", (inter, width)
            yield f"{mixer}.experts.{e}.down_proj.weight", (width, inter)
    else:
        yield f"{mixer}.experts.up_proj", (cfg.num_experts, inter, width)
        yield f"{mixer}.experts.down_proj", (cfg.num_experts, width, inter)
    yield f"{mixer}.shared_experts.up_proj.weight", (shared, h)
    yield f"{mixer}.shared_experts.down_proj.weight", (h, shared)
    if latent:
        yield f"{mixer}.fc1_latent_proj.weight", (latent, h)
        yield f"{mixer}.fc2_latent_proj.weight", (h, latent)


def _attention_shapes(cfg: ModelConfig, attn: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """An attention block's tensors; q_proj holds each head's gate after its query where there is an output
    gate (Qwen3-Next)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    for proj, rows in (("q_proj", 2 * q if cfg.attn_output_gate else q), ("k_proj", kv), ("v_proj", kv)):
        yield f"{attn}.{proj}.weight", (rows, h)
        if cfg.qkv_bias:
            yield f"{attn}.{proj}.bias", (rows,)
    yield f"{attn}.o_proj.weight", (h, q)
    if cfg.o_bias:
        yield f"{attn}.o_proj.bias", (h,)
    if cfg.qk_norm:
        yield f"{attn}.q_norm.weight", (hd,)
        yield f"{attn}.k_norm.weight", (hd,)


def _latent_attention_shapes(cfg: ModelConfig, attn: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """DeepSeek's latent attention block's tensors (layers/mla.py): q_proj, or q_a_proj, q_a_layernorm and q_b_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (biases on q_a, kv_a and o with attention_bias)."""
    h, heads, latent, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + rope
    if cfg.q_lora_rank:
        yield f"{attn}.q_a_proj.weight", (cfg.q_lora_rank, h)
        if cfg.qkv_bias:
            yield f"{attn}.q_a_proj.bias", (cfg.q_lora_rank,)
        yield f"{attn}.q_a_layernorm.weight", (cfg.q_lora_rank,)
        yield f"{attn}.q_b_proj.weight", (heads * qk, cfg.q_lora_rank)
    else:
        yield f"{attn}.q_proj.weight", (heads * qk, h)
    yield f"{attn}.kv_a_proj_with_mqa.weight", (latent + rope, h)
    if cfg.qkv_bias:
        yield f"{attn}.kv_a_proj_with_mqa.bias", (latent + rope,)
    yield f"{attn}.kv_a_layernorm.weight", (latent,)
    yield f"{attn}.kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), latent)
    yield f"{attn}.o_proj.weight", (h, heads * cfg.v_head_dim)
    if cfg.o_bias:
        yield f"{attn}.o_proj.bias", (h,)


def _linear_attention_shapes(cfg: ModelConfig, prefix: str,
                             split: bool | None = None) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A Gated DeltaNet block's tensors: Qwen3-Next's in_proj_qkvz and in_proj_ba (interleaved per key-head
    group), or with `split` Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (None: as the
    architecture stores them)."""
    h, kh, vh = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    channels = 2 * kh * kd + vh * vd
    if split is None:
        split = cfg.architecture.startswith("Qwen3_5")
    yield f"{prefix}.dt_bias", (vh,)
    yield f"{prefix}.A_log", (vh,)
    yield f"{prefix}.conv1d.weight", (channels, 1, cfg.linear_conv_kernel_dim)
    if split:
        yield f"{prefix}.in_proj_qkv.weight", (channels, h)
        yield f"{prefix}.in_proj_z.weight", (vh * vd, h)
        yield f"{prefix}.in_proj_b.weight", (vh, h)
        yield f"{prefix}.in_proj_a.weight", (vh, h)
    else:
        yield f"{prefix}.in_proj_qkvz.weight", (channels + vh * vd, h)
        yield f"{prefix}.in_proj_ba.weight", (2 * vh, h)
    yield f"{prefix}.norm.weight", (vd,)
    yield f"{prefix}.out_proj.weight", (h, vh * vd)


def expected_checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The full shape of every tensor a checkpoint of this config may hold: synthetic_checkpoint_shapes' names
    and the per-expert names of a mixture of experts (NemotronH's mixer.experts.{e}.{up,down}_proj,
    Qwen-MoE's mlp.experts.{e}.{gate,up,down}_proj,
    Mixtral's block_sparse_moe.experts.{e}.{w1,w3,w2} and router), and both layouts of Gated DeltaNet's input
    projections."""
    shapes = dict(synthetic_checkpoint_shapes(cfg))
    if cfg.architecture == "NemotronHForCausalLM":
        for i in cfg.moe_layers:
            shapes.update(_nemotron_h_moe_shapes(cfg, f"model.layers.{i}.mixer", per_expert=True))
        return shapes
    for i in cfg.linear_attention_layers:
        for split in (False, True):
            shapes.update(_linear_attention_shapes(cfg, f"model.layers.{i}.linear_attn", split))
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    for i in cfg.moe_layers:
        for block in ("mlp", "block_sparse_moe"):
            prefix = f"model.layers.{i}.{block}"
            shapes[f"{prefix}.gate.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                for part in ("gate_proj", "up_proj", "w1", "w3"):
                    shapes[f"{prefix}.experts.{e}.{part}.weight"] = (inter, h)
                for part in ("down_proj", "w2"):
                    shapes[f"{prefix}.experts.{e}.{part}.weight"] = (h, inter)
    return shapes


def synthetic_tensor(name: str, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype,
                     seed: int = 0) -> torch.Tensor:
    """The synthetic values of checkpoint tensor `name`: a function of (seed, name, shape) on a device kind."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).mul_(STD)
    if "norm" in name:
        values.add_(1.0)
    return values.to(dtype)


def iter_synthetic_checkpoint(model_config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                              seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every tensor of the checkpoint `model_config` describes, made one at a
    time on `device` in `dtype`."""
    for name, shape in synthetic_checkpoint_shapes(model_config):
        yield name, synthetic_tensor(name, shape, device, dtype, seed)


def _name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (seed, name): Python's hash() differs between processes."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
