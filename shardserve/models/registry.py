"""Which class builds each model architecture shardserve serves: the one list to read, and the one to extend.

An architecture is a name from config.json's "architectures" (a GGUF file's is derived by weights/gguf_loader.py).
Its class lives in a module under shardserve/models/ and is imported only when a model is built, so reading a
config needs no model code. Architectures whose networks are the same given their configs share a class
(Mistral is Llama). A new family is one module under shardserve/models/ and one entry in _MODELS.

Every class is built as `cls(model_config, comm, dtype, max_positions, expert_parallel=...)` and offers what the
engine and the weight loader use: forward, compute_logits, paged_attention and kv_heads_per_rank (of the layers
ModelConfig.kv_layers names: only those get KV-cache blocks; or, for a cache of another layout, cache_layout and
attention_backend: DeepSeek's latent cache, models/deepseek_v3.py), state_pools (the per-sequence states of a hybrid's
other layers), `packed_modules` and, where checkpoint names need more than that, `checkpoint_name`
(LlamaForCausalLM and MixtralForCausalLM show both). A class may also name parts of a checkpoint it does not read:
`unused_checkpoint_prefixes` (left unread silently), `skipped_checkpoint_prefixes` (prefix -> what it is: left
unread with one log line counting them) and `renamed_checkpoint_prefixes` (checkpoint prefix -> the model's, applied
before everything else: an image-text checkpoint's text model, models/qwen3_5.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# Architecture -> (module under shardserve.models, class in it).
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),  # with q/k/v biases (ModelConfig.qkv_bias)
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("mixtral", "MixtralForCausalLM"),  # with q/k/v biases and a shared expert
    "Qwen3MoeForCausalLM": ("qwen3", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),  # Gated DeltaNet and attention layers
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),  # Qwen3-Next's layers with dense MLPs
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),  # Mamba-2, attention, MLP and MoE blocks
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),  # latent attention, grouped-routing experts
    "DeepseekV2ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),  # the same given its config (softmax routing)
    # Image-text checkpoints: their text model (config.json's text_config), the vision tower left unread.
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))
# Models the engine builds from a served checkpoint, never named by a config.json (so not served by themselves): the
# multi-token-prediction layer of a DeepSeek checkpoint (engine/mtp.py).
_PART_MODELS: dict[str, tuple[str, str]] = {"DeepseekMTP": ("deepseek_mtp", "DeepseekMTP")}


class UnsupportedArchitecture(ValueError):
    """A model whose architecture shardserve has no class for; the message names it and the ones it serves."""

    def __init__(self, architecture: object) -> None:
        super().__init__(f"unsupported model architecture {architecture!r}: shardserve serves "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model a config.json describes: the config itself, or for an image-text checkpoint
    (Qwen3.5's ...ForConditionalGeneration) its `text_config` with the top level's architectures, and the keys the
    top level holds for the whole checkpoint (the LM head's tying, the quantization, the dtype) where it sets them."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or "num_hidden_layers" in cfg:
        return cfg
    merged = dict(text)
    for key in ("architectures", "tie_word_embeddings", "quantization_config", "torch_dtype", "dtype"):
        if key in cfg:
            merged[key] = cfg[key]
    if merged.get("eos_token_id") is None and cfg.get("eos_token_id") is not None:
        merged["eos_token_id"] = cfg["eos_token_id"]
    return merged


def resolve_architecture(architectures: list[str], model_type: str | None = None) -> str:
    """The first of a config's `architectures` that shardserve serves; UnsupportedArchitecture (naming them, or
    the model_type where the config lists none) if there is none."""
    found = next((a for a in architectures if a in _MODELS), None)
    if found is None:
        raise UnsupportedArchitecture(list(architectures) or model_type)
    return found


def model_class(architecture: str) -> type[nn.Module]:
    """The class that builds `architecture` (its module imported now): a served one, or a part model."""
    found = _MODELS.get(architecture) or _PART_MODELS.get(architecture)
    if found is None:
        raise UnsupportedArchitecture(architecture)
    module, name = found
    return getattr(importlib.import_module(f"shardserve.models.{module}"), name)
