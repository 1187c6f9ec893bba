"""Tiny random models in real architectures, saved like a Hugging Face checkpoint, for tests."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB_SIZE = 1000
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    name: str
    architecture: str
    config: dict[str, Any] = field(default_factory=dict)
    max_shard_size: str | None = None
    dtype: str = "float32"  # the dtype the checkpoint is saved in
    # An image-text checkpoint (Qwen3.5's ...ForConditionalGeneration): `config` is its text_config, this its
    # vision_config.
    vision: dict[str, Any] | None = None


TINY_SPECS = {
    # 6 query heads over 2 KV heads: at TP=3 a rank's two query heads can straddle two KV groups.
    "llama-tied": TinySpec("llama-tied", "llama", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=192,
        tie_word_embeddings=True)),
    # Untied head, Llama-3 RoPE scaling, and a checkpoint split over several safetensors files.
    "llama-untied": TinySpec("llama-untied", "llama", dict(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}), max_shard_size="300KB"),
    # 4 heads and 128 intermediate features do not split in 3: replicated blocks at TP=3.
    "qwen2": TinySpec("qwen2", "qwen2", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        tie_word_embeddings=True)),
    # head_dim set apart from hidden/heads, per-head q/k norms.
    "qwen3": TinySpec("qwen3", "qwen3", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=32, intermediate_size=192,
        tie_word_embeddings=False)),
}


# Long contexts with YaRN: "llama-yarn" stretches an original context of 64 positions 4 times (prompts and answers
# run past it); "llama-long" serves 32768 positions (4096 x 8) in one layer of 4 heads over 2 KV heads, for a 16k
# prompt through chunked prefill.
LONG_CONTEXT_SPECS = {
    "llama-yarn": TinySpec("llama-yarn", "llama", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        tie_word_embeddings=True, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64})),
    "llama-long": TinySpec("llama-long", "llama", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=1,
        max_position_embeddings=32768, tie_word_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096})),
}


# Odd shapes, saved as 16-bit checkpoints: 5 query heads over 1 KV head (attention replicated at TP 2 and 3,
# fewer KV heads than ranks), 150 MLP features (75 and 50 per rank: ragged kernel widths) and a vocabulary of
# 1000 that 3 ranks do not split evenly.
_ODD = dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1, head_dim=16, intermediate_size=150,
            tie_word_embeddings=False)
CHECKPOINT_DTYPE_SPECS = {
    f"llama-odd-{dtype}": TinySpec(f"llama-odd-{dtype}", "llama", _ODD, dtype=dtype)
    for dtype in ("bfloat16", "float16")
}


# Mixtures of experts, top-2 of 4 experts. Expert features (48) split in 2 and 3; Qwen3-MoE and Qwen2-MoE keep
# layer 1 dense (mlp_only_layers) so a model holds both kinds of block. "qwen3-moe-odd": 52 expert features, which 3 ranks do
# not split: the experts are then replicated.
MOE_SPECS = {
    "qwen3-moe": TinySpec("qwen3-moe", "qwen3_moe", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=32, intermediate_size=120,
        moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], num_hidden_layers=3, tie_word_embeddings=False)),
    "mixtral": TinySpec("mixtral", "mixtral", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False)),
    # Qwen2-MoE: q/k/v biases, a gated shared expert of 64 features (split in 2; whole at TP 3, where the routed
    # experts' 48 still split), no renormalisation of the top 2.
    "qwen2-moe": TinySpec("qwen2-moe", "qwen2_moe", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=120,
        moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3,
        tie_word_embeddings=False)),
    # Expert features (64) that split in two into whole quantization groups of 32 (packed experts at TP 2).
    "qwen3-moe-64": TinySpec("qwen3-moe-64", "qwen3_moe", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=32, intermediate_size=128,
        moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], num_hidden_layers=3, tie_word_embeddings=False)),
    "qwen3-moe-odd": TinySpec("qwen3-moe-odd", "qwen3_moe", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=52, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        tie_word_embeddings=True)),
}


# Hybrids of Gated DeltaNet and attention. "qwen3-next": layers 0 and 2 Gated DeltaNet, 1 and 3 attention (the
# first layer holds no KV cache), layer 1's MLP dense, the others sparse with a gated shared expert; RoPE over a
# quarter of each head, a gate on the attention output, zero-centred norms. 2 key heads over 4 value heads.
HYBRID_SPECS = {
    "qwen3-next": TinySpec("qwen3-next", "qwen3_next", dict(
        hidden_size=64, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)),
    # Its layers as [attention, Gated DeltaNet, attention, attention]: in two pipeline stages the second holds no
    # Gated DeltaNet layer.
    "qwen3-next-attention-last": TinySpec("qwen3-next-attention-last", "qwen3_next", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["full_attention", "linear_attention", "full_attention", "full_attention"],
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)),
    # Odd counts for two ranks: 3 query heads over 1 KV head, 3 key heads (each with 2 value heads) that do not
    # split in 2 (Gated DeltaNet replicated), half of each head rotated, sparse blocks every second layer.
    "qwen3-next-odd": TinySpec("qwen3-next-odd", "qwen3_next", dict(
        hidden_size=48, num_hidden_layers=3, full_attention_interval=3, num_attention_heads=3, num_key_value_heads=1,
        head_dim=16, intermediate_size=90, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, linear_num_key_heads=3,
        linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=True)),
}


# Qwen3.5: Qwen3-Next's layers with Gated DeltaNet's projections stored apart and multimodal RoPE (text positions
# only). "qwen3.5-moe": every layer sparse with a gated shared expert of the experts' size (folded into them, as
# the released models' are: layers/moe_shared.py), Gated DeltaNet over 3 key heads (split at TP
# 3, whole at TP 2), attention over 4 heads and 2 KV heads (split at TP 2, whole at TP 3), half of each head
# rotated. "qwen3.5": dense MLPs (96 features: split at TP 2 and 3), 5 query heads over 1 KV head (whole at any TP),
# Gated DeltaNet over 2 key heads of 4 value heads (split at TP 2), the default quarter of each head rotated.
# "qwen3.5-moe-vl" and "qwen3.5-vl": those text models in image-text checkpoints with a one-block vision tower (the
# dense one's LM head tied to the embedding at the top level of config.json).
_QWEN3_5_MOE_TEXT = dict(
    hidden_size=64, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
    linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
_QWEN3_5_TEXT = dict(
    hidden_size=48, num_hidden_layers=3, full_attention_interval=3, num_attention_heads=5, num_key_value_heads=1,
    head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=12, linear_conv_kernel_dim=4, tie_word_embeddings=True)


# NemotronH: one block per layer (Mamba-2, attention without RoPE, squared-ReLU MLP), SSD chunks of 16 or 8 tokens
# so that prompts span several and chunked prefill cuts inside one. "nemotron-h": 6 Mamba heads in 2 B/C groups
# (split at TP 2, a group per rank), 4 attention heads over 2 KV heads, the first layer Mamba-2. "nemotron-h-odd":
# 5 Mamba heads in 1 group (never split: whole on every rank), no conv bias, 3 attention heads over 1 KV head
# (whole at TP 2), 90 MLP features (45 per rank), the first layer attention, tie_word_embeddings set (which
# NemotronH ignores: its checkpoint holds an LM head of its own).
NEMOTRON_H_SPECS = {
    "nemotron-h": TinySpec("nemotron-h", "nemotron_h", dict(
        hidden_size=64, layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=6,
        mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, tie_word_embeddings=False)),
    # Four B/C groups of two heads: two groups (four heads) a rank at TP 2, as Nemotron-3-Nano's eight are.
    "nemotron-h-groups": TinySpec("nemotron-h-groups", "nemotron_h", dict(
        hidden_size=64, layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
        mamba_head_dim=8, ssm_state_size=16, n_groups=4, conv_kernel=4, chunk_size=16, tie_word_embeddings=False)),
    "nemotron-h-odd": TinySpec("nemotron-h-odd", "nemotron_h", dict(
        hidden_size=48, layers_block_type=["full_attention", "linear_attention", "mlp", "linear_attention"],
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, intermediate_size=90, mamba_num_heads=5,
        mamba_head_dim=8, ssm_state_size=8, n_groups=1, conv_kernel=3, chunk_size=8, use_conv_bias=False,
        tie_word_embeddings=True)),
    # Nemotron-3's mixture-of-experts layers. "nemotron-h-moe": 8 non-gated experts of 48 features (split in 2 and
    # 3; 4 whole experts a rank under expert parallelism at TP 2) in 2 groups of which the best 1 is kept, top 2
    # renormalised and scaled by 2.5, a shared expert of 32 features (split in 2, whole at TP 3), no latent
    # projections; the last layer a mixture of experts. "nemotron-h-latent": LatentMoE (experts at width 32 between
    # the latent projections), 6 experts in 3 groups of which 2 are kept, top 3 not renormalised, a shared expert
    # of 40 features (split in 2, whole at 3), odd head counts (3 query heads over 1 KV head, 5 Mamba heads in one
    # group: whole on every rank).
    "nemotron-h-moe": TinySpec("nemotron-h-moe", "nemotron_h", dict(
        hidden_size=64, layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=6,
        mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=48, moe_shared_expert_intermediate_size=32, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False)),
    # In two pipeline stages (layers 0-2 and 3-5): an attention layer in each, Mamba-2 in the first only.
    "nemotron-h-stages": TinySpec("nemotron-h-stages", "nemotron_h", dict(
        hidden_size=64, layers_block_type=["linear_attention", "full_attention", "moe", "full_attention", "moe", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=6,
        mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=48, moe_shared_expert_intermediate_size=32, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False)),
    "nemotron-h-latent": TinySpec("nemotron-h-latent", "nemotron_h", dict(
        hidden_size=48, layers_block_type=["moe", "linear_attention", "full_attention", "mlp", "moe"],
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, intermediate_size=64, mamba_num_heads=5,
        mamba_head_dim=8, ssm_state_size=8, n_groups=1, conv_kernel=3, chunk_size=8, n_routed_experts=6,
        num_experts_per_tok=3, moe_intermediate_size=48, moe_shared_expert_intermediate_size=40, moe_latent_size=32,
        n_group=3, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5, tie_word_embeddings=False)),
}


# DeepSeek-V3 and V2: latent attention (kv_lora_rank 32, rope keys of 8, nope 16, values 12), a dense first layer, then
# mixtures of experts with shared experts. "deepseek-v3": q through a bottleneck (q_lora_rank 24), 4 heads (split in
# 2, whole at 3), 8 experts of 32 features in 4 groups of which 2 are kept, top 2 renormalised and scaled by 2.5, a
# shared expert of 32 features (split in 2, whole at 3), interleaved rope. "deepseek-v3-noq": q_proj straight from the
# hidden states, 6 heads (split in 2 and 3), 6 experts (expert parallelism at 2: 3 a rank; at 3: 2), one group, 2
# shared experts (64 features), rope in halves (rope_interleave false). "deepseek-v3-odd": 5 experts, which 2 ranks
# do not divide (expert parallelism falls back to features), 3 heads, biases on q_a_proj, kv_a_proj_with_mqa and o_proj
# (attention_bias). "deepseek-v2": softmax routing
# (group_limited_greedy over 4 groups, 2 kept, not renormalised), q_lora_rank null, YaRN with mscale_all_dim
# (the softmax scale times mscale^2).
_DEEPSEEK = dict(hidden_size=64, num_hidden_layers=3, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=12, intermediate_size=96, moe_intermediate_size=32, first_k_dense_replace=1,
                 tie_word_embeddings=False)
DEEPSEEK_SPECS = {
    "deepseek-v3": TinySpec("deepseek-v3", "deepseek_v3", dict(
        _DEEPSEEK, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True)),
    "deepseek-v3-noq": TinySpec("deepseek-v3-noq", "deepseek_v3", dict(
        _DEEPSEEK, num_attention_heads=6, num_key_value_heads=6, q_lora_rank=None, n_routed_experts=6,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=True,
        routed_scaling_factor=1.0, rope_interleave=False)),
    "deepseek-v3-odd": TinySpec("deepseek-v3-odd", "deepseek_v3", dict(
        _DEEPSEEK, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=24, n_routed_experts=5,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, norm_topk_prob=False,
        routed_scaling_factor=1.5, attention_bias=True)),
    "deepseek-v2": TinySpec("deepseek-v2", "deepseek_v2", dict(
        _DEEPSEEK, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1})),
}


def _vision(out_hidden_size: int) -> dict[str, Any]:
    return dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=out_hidden_size,
                patch_size=4, num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)


QWEN3_5_SPECS = {
    "qwen3.5-moe": TinySpec("qwen3.5-moe", "qwen3_5_moe_text", _QWEN3_5_MOE_TEXT),
    "qwen3.5": TinySpec("qwen3.5", "qwen3_5_text", _QWEN3_5_TEXT),
    "qwen3.5-moe-vl": TinySpec("qwen3.5-moe-vl", "qwen3_5_moe", _QWEN3_5_MOE_TEXT, vision=_vision(64)),
    "qwen3.5-vl": TinySpec("qwen3.5-vl", "qwen3_5", _QWEN3_5_TEXT, vision=_vision(48)),
}


def _hf_config(spec: TinySpec):
    from transformers import (LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig,
                              Qwen3NextConfig)

    common = dict(vocab_size=VOCAB_SIZE, num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                  dtype="float32")
    if spec.architecture == "nemotron_h":
        from transformers import AutoConfig

        own = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
        return AutoConfig.for_model("nemotron_h", layer_norm_epsilon=1e-6, **{**own, **spec.config})
    if spec.architecture.startswith("deepseek"):
        from transformers import AutoConfig

        return AutoConfig.for_model(spec.architecture, **{**common, **spec.config})
    if spec.architecture.startswith("qwen3_5"):
        from transformers import AutoConfig

        if spec.vision is None:
            return AutoConfig.for_model(spec.architecture, **{**common, **spec.config})
        return AutoConfig.for_model(spec.architecture, text_config={**common, **spec.config},
                                    vision_config=spec.vision, tie_word_embeddings=spec.config["tie_word_embeddings"],
                                    dtype="float32")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
           "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig, "qwen3_next": Qwen3NextConfig}[spec.architecture]
    return cls(**{**common, **spec.config})


def _perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Default init leaves biases at 0 and norms at 1, which would hide a wrongly loaded one; and a mixture of
    experts' score-correction biases (buffers) at 0, which would hide one that weighs rather than only chooses."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            elif "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=generator) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)


def write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
                   "unk_token": "<unk>", "pad_token": "<unk>", "chat_template": CHAT_TEMPLATE,
                   "model_max_length": 512}, f)


# A Qwen-style template that lays out tools and tool calls (hermes: <tool_call> tags), for the byte tokenizer.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer without merges: any text encodes, one token per byte (ids 5..260), so a
    grammar can spell JSON, regexes and tool calls with it; the model's other ids decode to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
                   "unk_token": "<unk>", "pad_token": "<unk>", "chat_template": TOOLS_CHAT_TEMPLATE,
                   "model_max_length": 2048}, f)


def make_tiny_model(spec: TinySpec, path: str, seed: int = 0, tokenizer: str = "words") -> str:
    """Write config.json, safetensors and tokenizer files for `spec` into `path`; returns path. `tokenizer`:
    "words" (w5 ... w999, a word per token) or "bytes" (write_byte_tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if spec.vision is None else AutoModelForImageTextToText
    model = auto.from_config(_hf_config(spec), dtype=torch.float32)
    _perturb(model, torch.Generator().manual_seed(seed + 1))
    if spec.dtype != "float32":
        model = model.to(getattr(torch, spec.dtype))
        model.config.dtype = spec.dtype
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    (write_byte_tokenizer if tokenizer == "bytes" else write_tokenizer)(path)
    return path


def add_mtp_layer(spec: TinySpec, path: str, seed: int = 0) -> str:
    """Add to the tiny DeepSeek-V3 checkpoint of `spec` in `path` (make_tiny_model's) a random multi-token-prediction
    layer, as released V3 checkpoints store it (num_nextn_predict_layers 1): model.layers.{L}.* in mtp.safetensors
    beside the rest in decoder.safetensors (both in model.safetensors.index.json),
    the decoder layer as transformers saves layer L of a model one layer deeper, then enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head and a copy of the embedding. Returns path."""
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = _hf_config(spec)
    index = config.num_hidden_layers
    config.num_hidden_layers = index + 1
    torch.manual_seed(seed + 2)
    deeper = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 3)
    _perturb(deeper, generator)
    prefix = f"model.layers.{index}."
    with tempfile.TemporaryDirectory() as scratch:
        deeper.save_pretrained(scratch, safe_serialization=True)
        with safe_open(os.path.join(scratch, "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    h = config.hidden_size
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = 1 + torch.randn(h, generator=generator) * 0.1
    tensors[f"{prefix}eh_proj.weight"] = torch.randn(h, 2 * h, generator=generator) * 0.1
    tensors[f"{prefix}shared_head.head.weight"] = torch.randn(VOCAB_SIZE, h, generator=generator) * 0.1
    tensors[f"{prefix}embed_tokens.weight"] = embedding.clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "mtp.safetensors"))
    # Two files and an index, which transformers reads only where no model.safetensors is there.
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "decoder.safetensors"))
    with safe_open(os.path.join(path, "decoder.safetensors"), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), "decoder.safetensors")
    weight_map.update(dict.fromkeys(tensors, "mtp.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    written["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(written, f, indent=2)
    return path
