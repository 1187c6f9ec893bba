"""Model and engine configuration, resolved once at start-up and identical on every rank."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from shardserve.kv_cache_dtype import KV_CACHE_DTYPES
from shardserve.models.registry import SUPPORTED_ARCHITECTURES, resolve_architecture, text_model_config
from shardserve.weight_format import QuantScheme, parse_quantization

# Architectures that differ from Llama's in what their config.json does not say: Qwen2's q/k/v biases (without
# an o_proj bias), Qwen3's per-head q/k RMSNorms (models/qwen3.py).
_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
# Qwen3-Next and Qwen3.5: a sigmoid gate on the attention output (q_proj gives each head's query and gate),
# RMSNorm weights stored as offsets from 1 (the norm scales by 1 + w), and Gated DeltaNet layers beside attention
# (layer_types).
_HYBRID = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
           "Qwen3_5MoeForConditionalGeneration")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") + _HYBRID
# Mixtures of experts configured as Qwen-MoE's are (num_experts, decoder_sparse_step, mlp_only_layers); those with
# a gated shared expert.
_QWEN_MOE = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM",
             "Qwen3_5MoeForConditionalGeneration")
_SHARED_EXPERT = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM",
                  "Qwen3_5MoeForConditionalGeneration")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto": read the checkpoint; "dummy": synthetic weights in the model's shapes (shardserve/weights/synthetic.py).
LOAD_FORMATS = ("auto", "dummy")
# --quantization: quantize a float checkpoint at load (None: serve it as stored).
ONLINE_QUANTIZATION = (None, "fp8")
# --mamba-ssm-cache-dtype (vLLM's name): how Mamba-2 layers keep their SSM states between steps ("auto": float32).
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the model code needs; parsed from config.json or GGUF metadata."""

    architecture: str  # the config.json name that models/registry.py maps to the class that builds it
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (num_experts 0: a dense model): each layer in moe_layers has num_experts SwiGLU experts
    # of moe_intermediate_size features, num_experts_per_tok of them per token; renormalize_topk: the chosen
    # experts' softmax weights are scaled to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    renormalize_topk: bool = True
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one gated expert every token takes (0: none)
    # Weights stored quantized (GGUF Q4_1...) and dequantized at load: neither bfloat16 nor float16 holds
    # their values exactly.
    quantized: bool = False
    # A safetensors checkpoint's quantized linear layers (FP8, GPTQ): read as the values they encode
    # (weights/quantized.py).
    quantization: QuantScheme | None = None
    # Hybrid models (Qwen3-Next): each layer's token mixer, "full_attention" or "linear_attention" (Gated
    # DeltaNet, whose sizes are the linear_* fields); () where every layer is attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # the share of each head's dims that RoPE rotates (the first ones)
    attn_output_gate: bool = False  # attention output times sigmoid(gate), the gate from q_proj beside the query
    zero_centred_norm: bool = False  # RMSNorm weights w in the checkpoint scale by 1 + w
    # NemotronH: each layer is one block (layer_types "linear_attention" for Mamba-2, "full_attention", "mlp"),
    # the Mamba-2 layers' sizes (mamba_*), the MLP's activation, attention without RoPE.
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_kernel: int = 0
    mamba_chunk_size: int = 0
    mamba_time_step_limit: tuple[float, float] = (0.0, float("inf"))
    mamba_conv_bias: bool = False
    mamba_proj_bias: bool = False
    mlp_activation: str = "silu"
    rope: bool = True
    # NemotronH's mixture-of-experts layers ("moe", in moe_layers; the num_experts/moe_* fields above): non-gated
    # experts with mlp_activation, a non-gated shared expert of shared_expert_intermediate_size features, grouped
    # top-k routing on sigmoid scores (layers/grouped_topk.py: num_expert_groups groups, the topk_expert_groups best
    # kept, weights times routed_scaling_factor); moe_latent_size > 0: LatentMoE, the routed experts work at that
    # width between fc1_latent_proj and fc2_latent_proj.
    moe_latent_size: int = 0
    num_expert_groups: int = 1
    topk_expert_groups: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek-V2/V3's multi-head latent attention (models/deepseek_v3.py; kv_lora_rank 0: none). Each head's query
    # and key are [qk_nope_head_dim | qk_rope_head_dim] wide, its value v_head_dim; keys and values come from one
    # latent of kv_lora_rank features per token (kv_b_proj expands it), the rotated part of the key from a single
    # head shared by all. q_lora_rank 0: the query straight from the hidden states (q_proj), else through a
    # low-rank bottleneck (q_a_proj, q_a_layernorm, q_b_proj). head_dim is qk_rope_head_dim (the rotary tables').
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotated dims pair up as (0, 1), (2, 3)... rather than (i, i + half)
    # DeepSeek's routing (layers/grouped_topk.py): "sigmoid" scores with a score-correction bias (V3's noaux_tc),
    # or "softmax" (V2's greedy and group_limited_greedy) without one.
    scoring_func: str = "sigmoid"
    # DeepSeek-V3's multi-token-prediction layers, stored after the decoder layers as model.layers.{num_layers}...
    # (num_nextn_predict_layers; served by --speculative-config's method "mtp": engine/mtp.py).
    num_nextn_predict_layers: int = 0

    @property
    def latent_attention(self) -> bool:
        """Whether attention is DeepSeek's multi-head latent attention (one latent per token in the cache)."""
        return self.kv_lora_rank > 0

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that hold keys and values in the paged cache (every layer unless layer_types says)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """The layers with a per-sequence recurrent state instead of a KV cache (Gated DeltaNet, or NemotronH's
        Mamba-2 layers, which its config also calls linear_attention)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a config.json (an image-text checkpoint's: its text model, models/registry.text_model_config)."""
        cfg = text_model_config(cfg)
        arch = resolve_architecture(cfg.get("architectures") or [], cfg.get("model_type"))
        nemotron = _nemotron_h_fields(arch, cfg)
        deepseek = _deepseek_fields(arch, cfg)
        num_heads = cfg["num_attention_heads"]
        rope = _rope_parameters(cfg, cfg.get("max_position_embeddings", 4096))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,  # none where every layer is sparse (Qwen3.5-MoE)
            num_layers=len(nemotron["layer_types"]) if nemotron else cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=deepseek.get("qk_rope_head_dim") or attention_head_dim(cfg),
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5) if nemotron else cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope["rope_theta"],
            rope_scaling=rope["scaling"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            # NemotronH keeps its LM head apart whatever the config says (transformers ties none of its weights).
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not nemotron,
            qkv_bias=has_qkv_bias(cfg),
            o_bias=attention_bias and arch not in _QKV_BIAS,
            qk_norm=has_qk_norm(cfg),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            quantized=bool(cfg.get("gguf_quantized", False)),
            quantization=parse_quantization(cfg),
            **_moe_fields(arch, cfg),
            **_hybrid_fields(arch, cfg),
            **nemotron,
            **deepseek,
        )

    @classmethod
    def from_model_path(cls, path: str) -> "ModelConfig":
        if path.endswith(".gguf"):
            from shardserve.weights.gguf_loader import read_gguf_config

            return cls.from_hf_dict(read_gguf_config(path))
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(
                f"{path!r} is neither a .gguf file nor a model directory with a config.json"
            )
        with open(config_file) as f:
            return cls.from_hf_dict(with_modelopt_config(path, json.load(f)))

    @property
    def position_limit(self) -> int:
        """The longest context the model's positions allow: max_position_embeddings, or where a RoPE scaling
        stretches the original context (linear, YaRN, dynamic NTK), that context times its factor (vLLM's rule)."""
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] not in _STRETCHING_ROPE_SCALINGS:
            return self.max_position_embeddings
        original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        return int(original * scaling["factor"])

    def checkpoint_dtype(self) -> torch.dtype:
        return DTYPES.get(self.torch_dtype.replace("torch.", ""), torch.float32)


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (none for a dense model, nor for NemotronH, whose mixtures
    of experts _nemotron_h_moe_fields reads)."""
    if arch in ("NemotronHForCausalLM",) + _DEEPSEEK:
        return {}
    layers = cfg["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(num_experts=routed_experts(cfg), num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=expert_intermediate_size(cfg), renormalize_topk=True,
                    moe_layers=tuple(range(layers)))
    if arch in _QWEN_MOE:  # Qwen3.5-MoE's configs name no dense layers: every layer is sparse
        experts = routed_experts(cfg)
        qwen2 = arch == "Qwen2MoeForCausalLM"
        shared = arch in _SHARED_EXPERT
        sparse = sparse_layers(cfg) if experts > 0 else ()
        return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    # transformers' default for Qwen2-MoE: no renormalisation
                    renormalize_topk=bool(cfg.get("norm_topk_prob", not qwen2)), moe_layers=sparse,
                    shared_expert_intermediate_size=shared_expert_size(cfg) if shared else 0)
    return {}


# For a config.json that lists no architectures: the one its model_type names (as transformers' Auto classes read it).
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "nemotron_h": "NemotronHForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}


def architecture_of(cfg: dict[str, Any]) -> str | None:
    """The architecture shardserve serves that a config.json describes: the first of its architectures that it serves,
    or for a config listing none, its model_type's; None otherwise (the planner still sizes such a model)."""
    listed = cfg.get("architectures") or []
    if listed:
        return next((a for a in listed if a in SUPPORTED_ARCHITECTURES), None)
    return _MODEL_TYPE_ARCHITECTURES.get(cfg.get("model_type"))


def attention_head_dim(cfg: dict[str, Any]) -> int:
    """Features of one attention head: head_dim, or hidden_size split among the heads where a config names none
    (DeepSeek's rotary head_dim is its qk_rope_head_dim instead: _deepseek_fields)."""
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def has_qkv_bias(cfg: dict[str, Any]) -> bool:
    """Whether q_proj, k_proj and v_proj carry biases: Qwen2's and Qwen2-MoE's do (a Qwen2-MoE config may say
    otherwise with qkv_bias), known by their architectures or, for a config that lists none, their model_type;
    Llama-style configs say so with attention_bias."""
    qwen2 = architecture_of(cfg) in _QKV_BIAS
    return (qwen2 and bool(cfg.get("qkv_bias", True))) or bool(cfg.get("attention_bias", False))


def has_qk_norm(cfg: dict[str, Any]) -> bool:
    """Whether each head's query and key pass an RMSNorm before RoPE (Qwen3's families)."""
    return architecture_of(cfg) in _QK_NORM


def has_attention_output_gate(cfg: dict[str, Any]) -> bool:
    """Whether attention's output is gated by a sigmoid of a gate q_proj gives beside each head's query (Qwen3-Next's
    and Qwen3.5's)."""
    return architecture_of(cfg) in _HYBRID


def routed_experts(cfg: dict[str, Any]) -> int:
    """A mixture of experts' routed experts a sparse layer, under each family's name for them: num_experts (Qwen-MoE),
    num_local_experts (Mixtral, and newer transformers' Qwen-MoE), n_routed_experts (DeepSeek, NemotronH); 0: dense."""
    return cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0


def expert_intermediate_size(cfg: dict[str, Any]) -> int:
    """Features of one routed expert: moe_intermediate_size, or Mixtral's intermediate_size where it names none."""
    return cfg.get("moe_intermediate_size") or cfg["intermediate_size"]


def shared_expert_size(cfg: dict[str, Any]) -> int:
    """Features of the shared expert every token takes: shared_expert_intermediate_size (Qwen-MoE's), or DeepSeek's
    n_shared_experts experts of expert_intermediate_size each; 0 without one."""
    shared = cfg.get("shared_expert_intermediate_size")
    return shared or (cfg.get("n_shared_experts") or 0) * expert_intermediate_size(cfg)


def sparse_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The decoder layers of a mixture of experts that are sparse, by its config.json: DeepSeek's (a kv_lora_rank)
    from first_k_dense_replace on, every moe_layer_freq-th; the others' every decoder_sparse_step-th not in
    mlp_only_layers (Mixtral's, naming neither: every layer). NemotronH's are those its layers_block_type calls
    "moe" (_nemotron_h_moe_fields)."""
    layers = range(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):
        first_sparse, every = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        return tuple(i for i in layers if i >= first_sparse and i % every == 0)
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)


def is_gated_deltanet_hybrid(cfg: dict[str, Any]) -> bool:
    """Whether a config.json is Qwen3-Next's or Qwen3.5's: Gated DeltaNet layers beside attention."""
    return architecture_of(cfg) in _HYBRID


def hybrid_layer_types(cfg: dict[str, Any]) -> list[str]:
    """A Gated DeltaNet hybrid's token mixer for each layer: its layer_types, or where it names none (transformers'
    default) every full_attention_interval-th layer (4th) "full_attention", the others "linear_attention"."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    interval = cfg.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(cfg["num_hidden_layers"])]


def _hybrid_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5's fields: which layers are Gated DeltaNet and their sizes, partial RoPE, the
    output gate, the norms' offsets from 1 (none for other architectures).

    Qwen3.5's rope_parameters also carry mrope_section (multimodal RoPE: the rotated pairs split among time,
    height and width positions); a text token's three positions are all its index, so its rotation is the
    ordinary one over the same pairs, and only text is served."""
    if arch not in _HYBRID:
        return {}
    layers = cfg["num_hidden_layers"]
    types = hybrid_layer_types(cfg)
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown or len(types) != layers:
        raise ValueError(f"layer_types {types!r}: expected {layers} entries of 'full_attention' or "
                         f"'linear_attention'")
    if "full_attention" not in types:
        raise ValueError(f"layer_types {types!r} has no full_attention layer: shardserve serves hybrids with at "
                         f"least one attention layer")
    rope = cfg.get("rope_parameters") or {}
    # Where a config names none, transformers' default for Qwen3-Next and Qwen3.5: a quarter of each head rotated.
    rotated = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    return dict(layer_types=tuple(types), linear_num_key_heads=cfg["linear_num_key_heads"],
                linear_num_value_heads=cfg["linear_num_value_heads"],
                linear_key_head_dim=cfg["linear_key_head_dim"], linear_value_head_dim=cfg["linear_value_head_dim"],
                linear_conv_kernel_dim=cfg["linear_conv_kernel_dim"],
                partial_rotary_factor=rotated,
                attn_output_gate=True, zero_centred_norm=True)


_NEMOTRON_H_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Older NemotronH configs' names for layer types.
_NEMOTRON_H_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def _nemotron_h_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """NemotronH's fields: each layer's block (layers_block_type, or the older hybrid_override_pattern), the
    Mamba-2 sizes, the MLP's squared ReLU, no RoPE, the mixture-of-experts layers' sizes and routing (none for other
    architectures). Refuses what shardserve does not serve of the family: activations other than relu2 and silu,
    and what _nemotron_h_moe_fields refuses."""
    if arch != "NemotronHForCausalLM":
        return {}
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types and cfg.get("hybrid_override_pattern"):
        types = [_NEMOTRON_H_PATTERN.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if not types:
        raise ValueError("NemotronH config names no layers: expected layers_block_type or hybrid_override_pattern")
    types = [_NEMOTRON_H_TYPES.get(t, t) for t in types]
    unknown = sorted(set(types) - {"linear_attention", "full_attention", "mlp", "moe"})
    if unknown:
        raise ValueError(f"NemotronH layers_block_type {types!r}: unknown layer types {unknown}")
    if "full_attention" not in types:
        raise ValueError(f"NemotronH layers_block_type {types!r} has no full_attention layer: shardserve serves "
                         f"hybrids with at least one attention layer")
    act = cfg.get("mlp_hidden_act", "relu2")
    if act not in ("relu2", "silu"):
        raise ValueError(f"NemotronH with mlp_hidden_act={act!r}: only 'relu2' (and 'silu') are implemented")
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"NemotronH with mamba_hidden_act={cfg['mamba_hidden_act']!r}: only 'silu' is implemented")
    limit = cfg.get("time_step_limit", cfg.get("mamba_dt_limit")) or (0.0, float("inf"))
    return dict(layer_types=tuple(types), mamba_num_heads=cfg["mamba_num_heads"],
                mamba_head_dim=cfg["mamba_head_dim"], mamba_state_size=cfg["ssm_state_size"],
                mamba_n_groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 8)),
                mamba_conv_kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
                mamba_chunk_size=cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128)),
                mamba_time_step_limit=(_json_float(limit[0]), _json_float(limit[1])),
                mamba_conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
                mamba_proj_bias=bool(cfg.get("use_bias", False)), mlp_activation=act, rope=False,
                **_nemotron_h_moe_fields(cfg, types))


def with_modelopt_config(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields, with ModelOpt's hf_quant_config.json (its `quantization` section) as the
    quantization_config where config.json has none: older ModelOpt exports write their NVFP4 settings only there."""
    hf_quant = os.path.join(path, "hf_quant_config.json")
    if cfg.get("quantization_config") or not os.path.isfile(hf_quant):
        return cfg
    with open(hf_quant) as f:
        quantization = json.load(f).get("quantization") or {}
    return {**cfg, "quantization_config": {"quant_method": "modelopt", **quantization}}


@dataclass(frozen=True)
class CacheLayout:
    """One layer's cache on one rank: `planes` tensors [slots, heads, dim] (each layer's entry of
    kv_cache_layers is a tuple of them)."""

    planes: int
    heads: int
    dim: int

    @classmethod
    def keys_and_values(cls, kv_heads: int, head_dim: int) -> "CacheLayout":
        return cls(2, kv_heads, head_dim)


@dataclass(frozen=True)
class PipelineStage:
    """Which decoder layers one pipeline stage holds: [first_layer, end_layer) of num_layers, stage `index` of
    `count`. The first stage also holds the token embedding; the last the final norm and the LM head (and the
    embedding too where the head is tied to it). A model built whole is the one stage of one."""

    index: int
    count: int
    first_layer: int
    end_layer: int

    @classmethod
    def whole(cls, num_layers: int) -> "PipelineStage":
        return cls(0, 1, 0, num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    def holds(self, layer: int) -> bool:
        return self.first_layer <= layer < self.end_layer

    def describe(self) -> str:
        return f"stage {self.index} of {self.count} (layers {self.first_layer}-{self.end_layer - 1})"


def split_layers(layer_bytes: list[int], stages: int) -> list[range]:
    """Consecutive blocks of layers, one per stage, at least one layer each, whose largest block of bytes is as
    small as it can be (evenly by count where the layers are alike)."""
    n = len(layer_bytes)
    if not 1 <= stages <= n:
        raise ValueError(f"--pipeline-parallel-size {stages} needs at least one decoder layer per stage, but the "
                         f"model has {n}: use at most {n} stages")

    def blocks_within(limit: int) -> list[int] | None:
        """Ends of the blocks made by filling each up to `limit`, or None if that takes more than `stages`."""
        ends, total = [], 0
        for i, b in enumerate(layer_bytes):
            if total and total + b > limit:
                ends.append(i)
                total = 0
            total += b
        ends.append(n)
        return ends if len(ends) <= stages else None

    lo, hi = max(layer_bytes), sum(layer_bytes)
    while lo < hi:  # the smallest limit that `stages` blocks can keep
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if blocks_within(mid) is not None else (mid + 1, hi)
    ends = blocks_within(lo)
    while len(ends) < stages:  # fewer blocks than stages: split the largest block that has two layers
        starts = [0] + ends[:-1]
        widest = max((i for i in range(len(ends)) if ends[i] - starts[i] > 1),
                     key=lambda i: sum(layer_bytes[starts[i]:ends[i]]))
        ends.insert(widest, starts[widest] + (ends[widest] - starts[widest]) // 2)
    starts = [0] + ends[:-1]
    return [range(a, b) for a, b in zip(starts, ends)]


def refuse_stages_without_attention(blocks: list[range], attention_layers: list[int], architecture: str) -> None:
    """Every stage must hold an attention layer: a stage's KV cache and attention kernels are set up from its own
    attention layers (a hybrid's stage of Gated DeltaNet or Mamba-2 layers only is refused, naming it)."""
    for s, block in enumerate(blocks):
        if not any(i in block for i in attention_layers):
            raise ValueError(f"--pipeline-parallel-size {len(blocks)}: stage {s} (layers {block.start}-"
                             f"{block.stop - 1}) would hold no attention layer of {architecture} (its attention "
                             f"layers: {list(attention_layers)}); use fewer stages")


@dataclass(frozen=True)
class GroupedTopK:
    """How a grouped top-k router chooses (layers/grouped_topk.py's docstring). Invariants, checked at construction:
    num_experts splits into num_groups equal groups of at least 2 experts (a group's worth is its top two) when
    there is more than one group, 1 <= topk_groups <= num_groups, and the kept groups hold at least top_k experts."""

    num_experts: int
    top_k: int
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = True
    scaling_factor: float = 1.0
    scoring: str = "sigmoid"  # or "softmax"

    def __post_init__(self) -> None:
        per_group = self.num_experts // max(self.num_groups, 1)
        problems = []
        if self.scoring not in ("sigmoid", "softmax"):
            problems.append(f"scoring {self.scoring!r} is neither sigmoid nor softmax")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            problems.append(f"{self.num_experts} experts do not split into n_group={self.num_groups} equal groups")
        elif self.num_groups > 1 and per_group < 2 and self.scoring == "sigmoid":
            problems.append(f"groups of {per_group} expert: a group's worth is the sum of its two best scores")
        if not 1 <= self.topk_groups <= self.num_groups:
            problems.append(f"topk_group={self.topk_groups} is not between 1 and n_group={self.num_groups}")
        elif not 1 <= self.top_k <= self.topk_groups * per_group:
            problems.append(f"num_experts_per_tok={self.top_k} is more than the {self.topk_groups * per_group} "
                            f"experts of the kept groups")
        if problems:
            raise ValueError(f"grouped top-k routing: {'; '.join(problems)}")


def _nemotron_h_moe_fields(cfg: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """The mixture-of-experts fields of a NemotronH config whose layers_block_type names "moe" layers (none
    otherwise), as transformers' NemotronHMoE reads them: its one shared expert has moe_shared_expert_intermediate_size
    features (n_shared_experts must be 1: transformers and vLLM read other values differently). Refuses biases in the
    expert blocks (mlp_bias), which shardserve does not serve. (Quantized experts load as the values they encode.)"""
    moe_layers = tuple(i for i, t in enumerate(types) if t == "moe")
    if not moe_layers:
        return {}
    if cfg.get("n_shared_experts", 1) != 1:
        raise ValueError(f"NemotronH with n_shared_experts={cfg['n_shared_experts']}: only 1 is supported (one shared "
                         f"expert of moe_shared_expert_intermediate_size features, as transformers builds it)")
    if cfg.get("mlp_bias"):
        raise ValueError("NemotronH with mixture-of-experts layers and mlp_bias=true is not supported: the expert "
                         "blocks are served without biases")
    experts = routed_experts(cfg)
    route = GroupedTopK(experts, cfg["num_experts_per_tok"], cfg.get("n_group", 1), cfg.get("topk_group", 1),
                        bool(cfg.get("norm_topk_prob", True)), float(cfg.get("routed_scaling_factor", 1.0)))
    return dict(num_experts=experts, num_experts_per_tok=route.top_k, moe_intermediate_size=cfg["moe_intermediate_size"],
                renormalize_topk=route.renormalize, moe_layers=moe_layers,
                shared_expert_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
                moe_latent_size=cfg.get("moe_latent_size") or 0, num_expert_groups=route.num_groups,
                topk_expert_groups=route.topk_groups, routed_scaling_factor=route.scaling_factor)


_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# DeepSeek's routing methods: V3's noaux_tc (sigmoid scores, a score-correction bias, groups worth their two best),
# V2's greedy (softmax over all experts) and group_limited_greedy (softmax, groups worth their best).
_TOPK_METHODS = {"noaux_tc": "sigmoid", "greedy": "softmax", "group_limited_greedy": "softmax"}


def _deepseek_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's and V3's fields (none for other architectures): the latent attention's sizes, the rotation's
    pairing, and the mixture of experts: layers from first_k_dense_replace on (every moe_layer_freq-th) sparse, with
    n_shared_experts * moe_intermediate_size shared features and grouped routing (layers/grouped_topk.py).

    V3 always routes with noaux_tc (transformers reads no topk_method for it); V2 with its topk_method, groups only
    for group_limited_greedy. The rotation pairs neighbouring dims in V2 (its complex product) and in V3 where
    rope_interleave says (transformers' default: true)."""
    if arch not in _DEEPSEEK:
        return {}
    v3 = arch == "DeepseekV3ForCausalLM"
    method = "noaux_tc" if v3 else (cfg.get("topk_method") or "greedy")
    if method not in _TOPK_METHODS:
        raise ValueError(f"{arch} with topk_method={method!r}: shardserve routes with "
                         f"{', '.join(_TOPK_METHODS)}")
    grouped = method != "greedy"
    experts = routed_experts(cfg)
    route = GroupedTopK(experts, cfg["num_experts_per_tok"], (cfg.get("n_group") or 1) if grouped else 1,
                        (cfg.get("topk_group") or 1) if grouped else 1, bool(cfg.get("norm_topk_prob", v3)),
                        float(cfg.get("routed_scaling_factor") or 1.0), _TOPK_METHODS[method])
    return dict(num_experts=experts, num_experts_per_tok=route.top_k, moe_intermediate_size=cfg["moe_intermediate_size"],
                renormalize_topk=route.renormalize, moe_layers=sparse_layers(cfg) if experts else (),
                shared_expert_intermediate_size=shared_expert_size(cfg),
                num_expert_groups=route.num_groups, topk_expert_groups=route.topk_groups,
                routed_scaling_factor=route.scaling_factor, scoring_func=route.scoring,
                q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"], rope_interleave=not v3 or bool(cfg.get("rope_interleave", True)),
                num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0)


def _json_float(value: Any) -> float:
    """A float from config.json, where transformers 5 writes an infinite one as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


# RoPE scalings served (layers/rotary.py), and those that stretch the original context by their factor (the model's
# position limit is then original x factor, as vLLM reckons it; Llama-3's config states its stretched length).
ROPE_SCALINGS = ("llama3", "linear", "yarn", "dynamic")
_STRETCHING_ROPE_SCALINGS = ("linear", "yarn", "dynamic")


def _rope_parameters(cfg: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """Read RoPE settings from either the older (rope_theta, rope_scaling) keys or `rope_parameters`. YaRN and
    dynamic NTK get original_max_position_embeddings (default: max_position_embeddings) and YaRN its factor
    (default: their ratio), as transformers reads them."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or None
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind == "default":
            scaling = None
        elif kind not in ROPE_SCALINGS:
            raise ValueError(f"unsupported rope scaling type {kind!r}: shardserve supports {', '.join(ROPE_SCALINGS)}")
        else:
            scaling["rope_type"] = kind
            if kind in _STRETCHING_ROPE_SCALINGS[1:]:
                original = scaling.get("original_max_position_embeddings") or max_position_embeddings
                scaling["original_max_position_embeddings"] = original
                if scaling.get("factor") is None:
                    scaling["factor"] = max_position_embeddings / original
    return {"rope_theta": float(theta), "scaling": scaling}


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
_METHOD_ALIASES = {"deepseek_mtp": "mtp"}  # vLLM's older name
_LATER_METHODS = ("eagle", "eagle3", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON): up to num_speculative_tokens proposed tokens a decoding sequence, verified
    in one target step (engine/speculative.py). "ngram": prompt lookup, the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min. "draft_model":
    the greedy tokens of a smaller model of the same vocabulary, `model` (a directory or GGUF file), run on rank 0
    (engine/draft_model.py). "mtp" (alias "deepseek_mtp"): the greedy tokens of a DeepSeek-V2/V3 checkpoint's own
    multi-token-prediction layer, run on rank 0 (engine/mtp.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # "draft_model": the draft's path

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        """Refuses, naming the key, what it does not take: an unknown key, a method not built, bad counts, a draft
        model missing or given to another method. Whether the draft loads is checked where the target's config is
        at hand (engine/draft_model.check_draft_model)."""
        if not isinstance(values, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {values!r}")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; accepted: "
                             f"{', '.join(sorted(known))}")
        method = _METHOD_ALIASES.get(values.get("method"), values.get("method"))
        if method in _LATER_METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported yet; accepted: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{method!r}")
        config = cls(method, *(values.get(k, d) for k, d in (("num_speculative_tokens", None),
                                                              ("prompt_lookup_max", 4), ("prompt_lookup_min", 1),
                                                              ("model", None))))
        for name, low, high in (("num_speculative_tokens", 1, 16), ("prompt_lookup_max", 1, 64),
                                ("prompt_lookup_min", 1, 64)):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"--speculative-config: {name} must be a whole number from {low} to {high}, got "
                                 f"{value!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({config.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        config._check_model()
        return config

    def _check_model(self) -> None:
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("--speculative-config: method 'draft_model' needs \"model\", the draft model's directory "
                             f"or GGUF file, e.g. '{{\"method\": \"draft_model\", \"model\": \"/models/Llama-3.2-1B\", "
                             f"\"num_speculative_tokens\": 3}}'; got model {self.model!r}")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"--speculative-config: \"model\" names a draft model, which method {self.method!r} does "
                             "not take; use method 'draft_model'")

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON ({exc}): give e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from None
        return cls.from_dict(values)


@dataclass(frozen=True)
class EngineConfig:
    """Serve options that shape the engine; every rank derives the same values from them."""

    model: str
    tensor_parallel_size: int = 1
    # Stages, each a block of consecutive decoder layers on tensor_parallel_size ranks of its own (PipelineStage).
    pipeline_parallel_size: int = 1
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # CPU budget; GPU sizes from free memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False  # CUDA: run every step eagerly instead of replaying CUDA graphs
    load_format: str = "auto"  # one of LOAD_FORMATS
    # Variables rank 0 ships to every rank at start-up (distributed/handshake.py); rank 0's list counts.
    forward_env: tuple[str, ...] = ()
    wake_on_request: bool = False  # a request to a sleeping engine wakes it (else it waits for a wake-up)
    enable_expert_parallel: bool = False  # a mixture of experts: whole experts per rank, not experts split by features
    # "fp8": a float checkpoint's linear layers quantized at load (FP8 with a scale per output row); None: as stored.
    quantization: str | None = None
    # One of MAMBA_SSM_CACHE_DTYPES: the dtype of the Mamba-2 layers' SSM state pools (their recurrence always runs in
    # float32; only what is kept between steps is rounded). Models without Mamba-2 layers take "auto" only.
    mamba_ssm_cache_dtype: str = "auto"
    # How the KV cache stores keys and values (attention/kv_quant.py): "auto" (the compute dtype), "bfloat16", or
    # "fp8" / "fp8_e4m3" (e4m3 with per-layer scales from the checkpoint, else 1.0).
    kv_cache_dtype: str = "auto"
    # Proposed tokens verified in one step (engine/speculative.py); a dict is read as --speculative-config's JSON.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        for name, flag in (("tensor_parallel_size", "-tp"), ("pipeline_parallel_size", "-pp")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} ({flag}) must be a whole number of at least 1, got {value!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.quantization not in ONLINE_QUANTIZATION:
            raise ValueError(f"quantization must be one of {', '.join(map(str, ONLINE_QUANTIZATION))}, got "
                             f"{self.quantization!r}")
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype (--mamba-ssm-cache-dtype) must be one of "
                             f"{', '.join(MAMBA_SSM_CACHE_DTYPES)}, got {self.mamba_ssm_cache_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @property
    def world_size(self) -> int:
        """Ranks of the launch: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ssm_state_dtype(self) -> torch.dtype:
        """The Mamba-2 SSM state pools' dtype: mamba_ssm_cache_dtype, float32 for "auto"."""
        return DTYPES.get(self.mamba_ssm_cache_dtype, torch.float32)

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        """--max-model-len, or max_position_embeddings by default; refused above the model's position limit (a RoPE
        scaling may raise it past max_position_embeddings: ModelConfig.position_limit)."""
        if self.max_model_len is None:
            return model_config.max_position_embeddings
        limit = model_config.position_limit
        if self.max_model_len > limit:
            scaling = model_config.rope_scaling
            why = (f"max_position_embeddings {model_config.max_position_embeddings}" if limit ==
                   model_config.max_position_embeddings else f"{scaling['rope_type']} RoPE scaling: "
                   f"{scaling['original_max_position_embeddings']} x factor {scaling['factor']:g}")
            raise ValueError(f"--max-model-len {self.max_model_len} is above this model's limit of {limit} tokens "
                             f"({why}): lower --max-model-len to at most {limit}")
        return self.max_model_len
