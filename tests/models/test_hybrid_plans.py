"""`shardserve plan` for the hybrids at their real sizes, Qwen3-Next-80B-A3B and a Qwen3.5-397B-A17B-shaped image-text
config, against what a rank builds (on the meta device: no memory): the weights a rank holds, exactly, and the
recurrent state of a sequence, within 5% (the plan counts the convolution inputs in float32, the model keeps them
in its dtype), at TP 1, 2, 4 and 8. NemotronH (Nemotron-3 Nano's sizes, and a LatentMoE config) exactly, against a
rank built on the meta device and against what the engine allocates on a dummy load at Nano's widths."""

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


# NVIDIA-Nemotron-3-Nano-30B-A3B's config.json (its sizes): 23 Mamba-2, 23 mixture-of-experts and 6 attention layers,
# 128 non-gated experts of 1856 features (6 a token) and a shared expert of 3712. And a LatentMoE config of the same
# family at Nemotron-3-Super-like widths (not a released checkpoint's): experts at a latent width of 1024.
NEMOTRON_3_NANO = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_hidden_layers": 52,
    "intermediate_size": 1856, "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
    "conv_kernel": 4, "chunk_size": 128, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 131072, "max_position_embeddings": 262144,
    "layer_norm_epsilon": 1e-5, "mlp_hidden_act": "relu2", "mlp_bias": False, "use_bias": False,
    "use_conv_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
NEMOTRON_LATENT = {**NEMOTRON_3_NANO, "hidden_size": 4096, "moe_latent_size": 1024, "n_routed_experts": 256,
                   "num_experts_per_tok": 16, "moe_intermediate_size": 2688, "moe_shared_expert_intermediate_size": 5376,
                   "n_group": 8, "topk_group": 4, "num_attention_heads": 40, "num_key_value_heads": 8,
                   "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*E"}


@pytest.mark.parametrize("config", [NEMOTRON_3_NANO, NEMOTRON_LATENT], ids=["nano", "latent"])
def test_the_nemotron_h_plan_is_what_a_rank_builds(config, tmp_path):
    """Weights exactly, KV cache per token and Mamba-2 state per sequence exactly (conv inputs in bfloat16, SSM states
    in float32 or bfloat16), at TP 1, 2, 4 and 8; the Nano config's 31.6B parameters."""
    from shardserve.planner import PlanRequest, kv_bytes_per_token, plan

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = load_hf_config(str(tmp_path))
    cfg = ModelConfig.from_model_path(str(tmp_path))
    for tp in (1, 2, 4, 8):
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg, Communicator(None, 0, tp), torch.bfloat16, max_positions=4096)
        built = sum(p.numel() for p in model.parameters())
        if tp == 1 and config is NEMOTRON_3_NANO:
            assert abs(built - 31.58e9) / 31.58e9 < 0.01, f"{built / 1e9:.2f}B parameters"
        assert weight_elements_per_rank(hf, tp, []) == built, f"TP={tp}"
        kv = 2 * len(cfg.kv_layers) * model.kv_heads_per_rank() * cfg.head_dim * 2
        assert kv_bytes_per_token(hf, tp, 2) == kv, f"TP={tp}"
        for ssm_dtype in ("auto", "bfloat16"):
            pools = model.state_pools(1, torch.device("meta"),
                                      ssm_dtype=None if ssm_dtype == "auto" else torch.bfloat16).values()
            state = sum(t.numel() * t.element_size() for pool in pools for t in pool)
            planned = plan(hf, PlanRequest(tp, mamba_ssm_cache_dtype=ssm_dtype)).state_bytes_per_seq
            assert planned == state, f"TP={tp}, {ssm_dtype} SSM states: {planned} planned, {state} built"


def test_the_nemotron_h_plan_is_what_a_dummy_load_allocates(tmp_path):
    """The engine at TP 2 on --load-format dummy, at Nano's widths with three layers (Mamba-2, mixture of experts,
    attention), 8 of its experts and a vocabulary of 4096 (CPU memory): what rank 0 allocates for its weights, the
    KV cache per token and the Mamba-2 states per sequence is the CPU plan's within 5%."""
    from shardserve import LLM
    from shardserve.layers.linear import weight_bytes
    from shardserve.planner import PlanRequest, plan
    from tests.tiny_models import write_tokenizer

    config = {**NEMOTRON_3_NANO, "layers_block_type": ["linear_attention", "moe", "full_attention"],
              "num_hidden_layers": 3, "n_routed_experts": 8, "vocab_size": 4096, "torch_dtype": "float32"}
    del config["hybrid_override_pattern"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_tokenizer(str(tmp_path))
    seqs = 4
    expected = plan(load_hf_config(str(tmp_path)), PlanRequest(2, max_num_seqs=seqs, device="cpu"))
    with LLM(str(tmp_path), tensor_parallel_size=2, device="cpu", load_format="dummy", kv_cache_memory_gb=0.05,
             max_num_seqs=seqs, max_model_len=256) as llm:
        runner = llm.engine.runner
        allocated = {"weights": weight_bytes(runner.model)[0],
                     "KV per token": runner._kv_bytes_per_block() // runner.block_size,
                     "state per sequence": sum(t.numel() * t.element_size() for pool in runner.state_pools.values()
                                               for t in pool) // seqs}
    planned = {"weights": expected.weight_bytes, "KV per token": expected.kv_bytes_per_token,
               "state per sequence": expected.state_bytes_per_seq}
    for what, size in allocated.items():
        assert abs(planned[what] - size) / size < 0.05, f"{what}: {planned[what]} planned, {size} allocated"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("excluded", ["the head alone 16-bit", "as NVIDIA ships it"])
def test_an_nvfp4_nemotron_h_is_planned_as_a_rank_holds_it_packed(tp, excluded, tmp_path):
    """Nemotron-3-Nano as a ModelOpt NVFP4 checkpoint (e2m1 codes, an e4m3 byte a group of 16, a float32 scale a
    row; the head 16-bit, or also the attention layers and the Mamba-2 layers before them, as NVIDIA's exclude_modules
    name them): the plan's weights on GPUs are what a rank holds once its layers and experts are packed (built on the
    meta device, the modules to pack read from the config as a dummy load reads them) within 0.5%, where it once
    planned less than nothing."""
    from shardserve.layers.linear import deferred_weights
    from shardserve.layers.moe_packed import pack_experts
    from shardserve.layers.quantization.packed import PackedLayout
    from shardserve.layers.quantization.selection import pack_layers
    from shardserve.planner import PlanRequest, plan
    from shardserve.weights.loader import configured_quantized_modules

    from benchmarks.gpu_suite import nvidia_nvfp4_exclusions

    kept = ["lm_head"] if excluded == "the head alone 16-bit" else \
        nvidia_nvfp4_exclusions(NEMOTRON_3_NANO["hybrid_override_pattern"])
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": kept}
    config = {**NEMOTRON_3_NANO, "quantization_config": nvfp4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_model_path(str(tmp_path))
    with torch.device("meta"), deferred_weights():
        model = model_class(cfg.architecture)(cfg, Communicator(None, 0, tp), torch.bfloat16, max_positions=4096)
    layout, names = PackedLayout.of_checkpoint(cfg.quantization), configured_quantized_modules(model, cfg.quantization)
    assert pack_layers(model, names, layout, "meta", log=False, head=cfg.quantization.lm_head)
    assert pack_experts(model, names, layout, "meta", log=False) == 23
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = plan(load_hf_config(str(tmp_path)), PlanRequest(tp, gpu_memory_gb=141)).weight_bytes
    assert abs(planned - held) / held < 0.005, f"TP={tp}: {planned / 2**30:.3f} GiB planned, {held / 2**30:.3f} held"
    left = {name for name, m in model.named_modules() if getattr(m, "packed", 1) is None and name != "lm_head"}
    if excluded == "as NVIDIA ships it":  # 6 attention layers' q|k|v and o, 6 Mamba-2 layers' in_proj and out_proj
        assert len(left) == 24 and "model.layers.5.mixer.qkv_proj" in left and "model.layers.4.mixer.in_proj" in left
    else:
        assert not left
