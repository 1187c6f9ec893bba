"""`shardserve plan` for the hybrids at their real sizes, Qwen3-Next-80B-A3B and a Qwen3.5-397B-A17B-shaped image-text
config, against what a rank builds (on the meta device: no memory): the weights a rank holds, exactly, and the
recurrent state of a sequence, within 5% (the plan counts the convolution inputs in float32, the model keeps them
in its dtype), at TP 1, 2, 4 and 8."""

from __future__ import annotations

import json
import sys

import pytest
import torch

sys.path.insert(0, "benchmarks")
from gpu_suite import QWEN3_NEXT_80B_A3B  # noqa: E402

from shardserve.config import ModelConfig  # noqa: E402
from shardserve.distributed.communicator import Communicator  # noqa: E402
from shardserve.models import model_class  # noqa: E402
from shardserve.planner import load_hf_config, state_bytes_per_seq, weight_elements_per_rank  # noqa: E402

# 60 layers of hidden size 4096 (three Gated DeltaNet layers then one gated attention layer), 512 experts of 1024
# features (10 a token, and a shared one), in an image-text checkpoint's text_config.
QWEN3_5_397B_TEXT = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 4096, "num_hidden_layers": 60, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 64,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(60)],
    "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024, "vocab_size": 248320, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
QWEN3_5_397B = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "tie_word_embeddings": False, "text_config": QWEN3_5_397B_TEXT}
CONFIGS = {"qwen3-next-80b-a3b": (QWEN3_NEXT_80B_A3B, 79.7e9), "qwen3.5-397b-a17b": (QWEN3_5_397B, 397e9)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_plan_is_what_a_rank_builds(name, tmp_path):
    config, total = CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = load_hf_config(str(tmp_path))  # as `shardserve plan` reads it
    cfg = ModelConfig.from_model_path(str(tmp_path))
    for tp in (1, 2, 4, 8):
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg, Communicator(None, 0, tp), torch.bfloat16,
                                                  max_positions=4096)
        built = sum(p.numel() for p in model.parameters())
        if tp == 1:  # the shape is the model's: its parameter count is the name's
            assert abs(built - total) / total < 0.01, f"{name}: {built / 1e9:.1f}B parameters"
        assert weight_elements_per_rank(hf, tp, []) == built, f"{name} TP={tp}"
        state = sum(t.numel() * t.element_size() for pool in model.state_pools(1, torch.device("meta")).values()
                    for t in pool)
        planned = state_bytes_per_seq(hf, tp, 4)
        assert abs(planned - state) / state < 0.05, f"{name} TP={tp}: state {planned} planned, {state} built"
