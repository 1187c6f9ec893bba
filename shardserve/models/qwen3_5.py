"""Qwen3.5: Qwen3-Next's network (models/qwen3_next.py) in two sizes of feed-forward block, and the text model of
its image-text checkpoints.

What transformers' qwen3_5 and qwen3_5_moe modeling code changes from Qwen3-Next, and where shardserve has it:
- Gated DeltaNet's input projections are stored apart, head-major (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
  rather than interleaved per key-head group (in_proj_qkvz, in_proj_ba): GatedDeltaNet.packed_modules reads both
  into the same local layout (layers/deltanet_projections.py). The convolution, A_log, dt_bias, the gated RMSNorm
  (weights as stored, not offsets from 1) and out_proj are Qwen3-Next's.
- RoPE is multimodal (mrope_section in rope_parameters), over the first partial_rotary_factor of each head; for
  text, whose three positions are one, that is Qwen3-Next's partial RoPE (config._hybrid_fields).
- Qwen3_5ForCausalLM: a dense SwiGLU MLP in every layer (its config has no experts, so ModelConfig.moe_layers is
  empty). Qwen3_5MoeForCausalLM: a sparse block in every layer (no decoder_sparse_step or mlp_only_layers), with
  Qwen3-Next's gated shared expert; the router always renormalises the chosen experts' weights.
- The attention (gated, per-head q/k norms) and the zero-centred RMSNorms are Qwen3-Next's.

...ForConditionalGeneration checkpoints hold the same text model under `model.language_model.` (config.json's
text_config, read by ModelConfig.from_hf_dict), the LM head at `lm_head.`, and a vision tower under `model.visual.`
that is left unread: the weight loader counts its tensors and logs one line. Released checkpoints also carry a
multi-token-prediction layer (`mtp.`), unread as Qwen3-Next's.
"""

from __future__ import annotations

from shardserve.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    # Where an image-text checkpoint's tensors go (models/registry.py describes these attributes; weights/loader.py
    # reads them): its text model's into the model's names, its vision tower's nowhere. Text checkpoints hold
    # neither prefix; transformers' Qwen3.5 causal LMs read image-text checkpoints the same way.
    renamed_checkpoint_prefixes = {"model.language_model.": "model."}
    skipped_checkpoint_prefixes = {"model.visual.": "the vision tower"}


class Qwen3_5ForCausalLM(Qwen3_5MoeForCausalLM):
    """Every layer's feed-forward block dense: the config has no experts, so ModelConfig.moe_layers is empty."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    pass


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    pass
