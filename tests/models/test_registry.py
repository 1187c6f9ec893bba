"""The model registry: every architecture shardserve accepts is built by a class that takes its checkpoint, and
an unknown one is refused by name, with the supported list, before any weights are read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.config import CacheLayout
from shardserve.model_files import ModelPathError, check_model_path
from shardserve.models import SUPPORTED_ARCHITECTURES, UnsupportedArchitecture, model_class
from shardserve.weights import gguf_loader
from shardserve.weights.loader import load_synthetic_weights

SERVED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "NemotronHForCausalLM", "Qwen2ForCausalLM",
          "Qwen2MoeForCausalLM",
          "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
          "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")

# A small config every architecture reads (the mixture-of-experts keys are ignored by the dense ones).
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100, "num_experts": 4, "num_local_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
         "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
         "layers_block_type": ["linear_attention", "full_attention"], "mamba_num_heads": 4, "mamba_head_dim": 16,
         "ssm_state_size": 16, "n_groups": 2, "n_routed_experts": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
         "qk_nope_head_dim": 8, "v_head_dim": 16, "n_shared_experts": 1, "first_k_dense_replace": 1}


def test_the_supported_architectures_are_those_served_so_far():
    assert SUPPORTED_ARCHITECTURES == SERVED


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2)])
def test_every_supported_architecture_builds_a_model_that_takes_its_checkpoint(architecture, rank, world):
    cfg = ModelConfig.from_hf_dict({**SMALL, "architectures": ["SomethingElse", architecture]})
    assert cfg.architecture == architecture
    model = model_class(architecture)(cfg, Communicator(None, rank, world), torch.float32, max_positions=32)
    load_synthetic_weights(model, cfg, "cpu", torch.float32)  # every tensor has a place, every parameter a tensor
    if cfg.latent_attention:  # DeepSeek: one [latent | rope key] entry a token, whole on every rank
        assert model.cache_layout() == CacheLayout(1, 1, 16 + 8)
    else:
        assert model.kv_heads_per_rank() == 2 // world


def test_every_architecture_a_gguf_file_can_name_is_supported():
    named = {model for model, _ in gguf_loader._ARCHITECTURES.values()} | {gguf_loader._MIXTRAL[0]}
    assert named <= set(SUPPORTED_ARCHITECTURES)


def test_an_unknown_architecture_is_named_with_the_supported_list():
    with pytest.raises(UnsupportedArchitecture) as raised:
        ModelConfig.from_hf_dict({**SMALL, "architectures": ["GPTNeoXForCausalLM"]})
    assert str(raised.value) == ("unsupported model architecture ['GPTNeoXForCausalLM']: shardserve serves "
                                 + ", ".join(SERVED))
    with pytest.raises(UnsupportedArchitecture, match="unsupported model architecture 'gpt_neox': shardserve serves "
                                                      "DeepseekV2ForCausalLM, "):
        ModelConfig.from_hf_dict({**SMALL, "model_type": "gpt_neox"})  # no architectures listed
    with pytest.raises(UnsupportedArchitecture, match="'GPTNeoXForCausalLM': shardserve serves DeepseekV2ForCausalLM, "):
        model_class("GPTNeoXForCausalLM")


def test_an_unknown_architecture_is_refused_before_any_weights_are_read(tiny_model_dir, tmp_path):
    from shardserve import LLM

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama-tied"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    for weights in path.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")  # reading them would fail with another error
    expected = "unsupported model architecture \\['GPTNeoXForCausalLM'\\]: shardserve serves DeepseekV2ForCausalLM, "
    with pytest.raises(ModelPathError, match=expected):
        check_model_path(str(path))
    with pytest.raises(ModelPathError, match=expected):
        LLM(str(path))
