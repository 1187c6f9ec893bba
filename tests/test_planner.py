"""`shardserve plan`: the planner's numbers against arithmetic done by hand for real model configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardserve.planner import GIB, PlanRequest, plan
from tests.helpers.configs import LLAMA3_8B

LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "max_position_embeddings": 131072}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
             "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "max_position_embeddings": 40960, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
HYBRID = {"model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
          "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936,
          "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12,
          "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
          "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_llama3_8b_weights_and_kv_at_tp1_and_tp2():
    # Per layer: q, k, v, o = 4096*(32+8+8)*128 + 32*128*4096; MLP 3*4096*14336; two norms of 4096.
    layer = 4096 * 48 * 128 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    params = 32 * layer + 2 * 128256 * 4096 + 4096  # untied embedding and head, final norm
    assert params == 8_030_261_248
    one = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=1))
    assert one.weight_bytes == 2 * params  # 16.06 GB
    assert one.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    two = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=2))
    layer2 = 4096 * 24 * 128 + 2048 * 4096 + 3 * 4096 * 7168 + 2 * 4096  # heads and MLP halved, norms whole
    assert two.weight_bytes == 2 * (32 * layer2 + 2 * 64128 * 4096 + 4096)
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2


def test_a_tensor_parallel_rank_reserves_its_collectives_buffers():
    """NCCL's communicator buffers and the peer-memory areas exist only with several GPUs: a TP=2 rank's overhead is
    a TP=1 rank's, less the halved MLP activations and graph buffers, plus GPU_COLLECTIVE_OVERHEAD."""
    from shardserve.planner import GPU_COLLECTIVE_OVERHEAD

    request = {"max_num_seqs": 64, "max_num_batched_tokens": 2048}
    one = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=1, **request))
    two = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=2, **request))
    halved = (2048 + 64) * 3 * (14336 - 14336 // 2) * 2  # activations and graph buffers of the MLP's features
    assert two.overhead_bytes == one.overhead_bytes - halved + GPU_COLLECTIVE_OVERHEAD
    on_cpu = [plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=tp, device="cpu", **request)) for tp in (1, 2)]
    assert on_cpu[1].overhead_bytes == on_cpu[0].overhead_bytes - 2048 * 3 * (14336 - 14336 // 2) * 4


def test_larger_decode_batches_reserve_the_peer_all_reduces_larger_slots():
    """At 512 sequences the decode graphs' all-reduce carries 4 MiB: the peer-memory area's five slots a rank and
    peer grow from 512 KiB to that, and a TP rank's plan reserves the difference (a TP=1 rank's does not)."""
    small, large = ({"max_num_seqs": n, "max_num_batched_tokens": 8192} for n in (64, 512))

    def tp_cost(tp: int, request: dict) -> int:  # a TP rank's overhead beyond a TP=1 rank's
        return (plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=tp, **request)).overhead_bytes
                - plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=1, **request)).overhead_bytes)

    for tp in (2, 4):
        halved_graphs = (512 - 64) * 3 * (14336 - 14336 // tp) * 2  # the graphs' MLP buffers shrink with TP
        assert tp_cost(tp, large) - tp_cost(tp, small) + halved_graphs == 5 * tp * (4 * 2**20 - 512 * 1024)


def test_llama3_70b_at_tp8_fits_an_h200_and_refuses_one_80gb_gpu_at_tp1():
    eight = plan(LLAMA3_70B, PlanRequest(tensor_parallel_size=8, max_model_len=8192, gpu_memory_gb=139.8))
    layer = (8192 * 10 * 128 + 8 * 128 * 8192) + 3 * 8192 * 3584 + 2 * 8192  # 8 q + 1 k + 1 v heads per rank
    assert eight.weight_bytes == 2 * (80 * layer + 2 * 16032 * 8192 + 8192)
    assert eight.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    assert eight.fits
    one = plan(LLAMA3_70B, PlanRequest(tensor_parallel_size=1, max_model_len=8192, gpu_memory_gb=80))
    assert one.fits is False and one.weight_bytes > 140 * 10**9
    assert "exceed the usable 72.00 GiB per device" in one.reasons[0]
    assert one.largest_context == 0


def test_qwen3_moe_counts_every_expert_and_the_router():
    moe = plan(QWEN3_MOE, PlanRequest(tensor_parallel_size=1))
    attn = 2048 * (32 + 8) * 128 + 32 * 128 * 2048 + 2 * 128  # with q_norm and k_norm
    experts = 128 * 3 * 2048 * 768 + 2048 * 128
    params = 48 * (attn + experts + 2 * 2048) + 2 * 151936 * 2048 + 2048
    assert moe.weight_bytes == 2 * params  # about 30.5 B parameters
    assert 30.4e9 < params < 30.6e9
    assert moe.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    # What a token reads: attention, the router and 8 of the 128 experts a layer (about 3.3 B parameters).
    active = 48 * (attn + 8 * 3 * 2048 * 768 + 2048 * 128 + 2 * 2048) + 2 * 151936 * 2048 + 2048
    assert moe.active_weight_bytes == 2 * active and 3.2e9 < active < 3.4e9


def test_hybrid_model_grows_kv_only_in_full_attention_layers_and_keeps_fixed_state_elsewhere():
    tp1 = plan(HYBRID, PlanRequest(tensor_parallel_size=1, max_model_len=1_000_000, gpu_memory_gb=139.8))
    assert tp1.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2  # 12 of 48 layers hold KV
    # Gated DeltaNet state per sequence: 32 value heads of a 128x128 matrix, plus a 3-step conv window
    # over q, k, v (2*16*128 + 32*128 channels), in float32, in each of 36 linear-attention layers.
    assert tp1.state_bytes_per_seq == 36 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 4
    # A million tokens of context: 24 KiB per token, under 24 GiB of KV for one sequence.
    assert tp1.kv_bytes_for_context == 1_000_000 * 24576


def test_plan_refuses_a_context_that_does_not_fit_and_names_the_largest_that_does(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    result = subprocess.run([sys.executable, "-m", "shardserve", "plan", str(tmp_path), "--gpu-memory-gb", "20",
                             "--max-model-len", "8192", "--max-num-seqs", "4", "--host-memory-gb", "64"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    small = plan(LLAMA3_8B, PlanRequest(max_model_len=8192, gpu_memory_gb=18.5, max_num_seqs=4))
    assert small.fits is False and 0 < small.largest_context < 8192
    expected_tokens = (int(18.5 * GIB * 0.9) - small.weight_bytes - small.overhead_bytes) // (128 * 1024)
    assert small.largest_context == expected_tokens
    result = subprocess.run([sys.executable, "-m", "shardserve", "plan", str(config), "--gpu-memory-gb", "18.5",
                             "--max-model-len", "8192", "--max-num-seqs", "4", "--host-memory-gb", "64"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert (f"fits: NO: a sequence of --max-model-len 8,192 tokens needs 1.00 GiB of KV cache per rank, but "
            f"{small.kv_budget_bytes / GIB:.2f} GiB ({expected_tokens:,} tokens) is left for it: the usable 16.65 GiB "
            f"per device less the weights (14.96 GiB) and overhead") in result.stdout
    assert f"the largest --max-model-len that fits: {expected_tokens:,}" in result.stdout


def test_a_plan_that_does_not_fit_says_what_does_not_and_offers_a_shorter_context_only_where_one_would():
    from shardserve.planner import describe

    host = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=2, max_model_len=8192, device="cpu", host_memory_gb=55,
                                       kv_cache_memory_gb=2.0))
    text = describe(host, 2)
    assert "fits: NO: 2 ranks need" in text and "GiB of host memory (each: weights 22.44 GiB" in text
    assert "under the floor of 6 GiB (--host-floor-gb)" in text
    assert "the largest --max-model-len" not in text, "the context fits: a shorter one would not help"

    small_gpu = plan(LLAMA3_8B, PlanRequest(gpu_memory_gb=12, max_num_seqs=4))
    no_room = describe(small_gpu, 1)
    assert (f"fits: NO: weights (14.96 GiB) and overhead ({small_gpu.overhead_bytes / GIB:.2f} GiB at --max-num-seqs 4 "
            f"and --max-num-batched-tokens 2048) exceed the usable 10.80 GiB per device (12 GiB x 0.9), leaving "
            f"nothing for the KV cache") in no_room
    assert "the largest --max-model-len" not in no_room

    whole = describe(plan(LLAMA3_70B, PlanRequest(tensor_parallel_size=8, gpu_memory_gb=24)), 8)
    assert "fits: NO: a sequence of the model's whole context, 131,072 tokens (--max-model-len not given)," in whole
    assert "the largest --max-model-len that fits: " in whole


def test_json_output_and_the_host_memory_floor(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    result = subprocess.run([sys.executable, "-m", "shardserve", "plan", str(config), "-tp", "8", "--json",
                             "--gpu-memory-gb", "80", "--host-memory-gb", "24"], capture_output=True, text=True,
                            timeout=60)
    data = json.loads(result.stdout)
    assert data["fits"] is True and data["kv_bytes_per_token"] == 2 * 32 * 1 * 128 * 2
    assert any("under the floor of 6 GiB" in w for w in data["warnings"]), data["warnings"]


def test_planned_weights_equal_what_the_engine_builds_for_every_family_and_tp(tiny_model_dir):
    import torch

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models import model_class
    from shardserve.planner import load_hf_config, weight_elements_per_rank
    from tests.tiny_models import MOE_SPECS, TINY_SPECS

    for name in {**TINY_SPECS, **MOE_SPECS}:
        model_dir = tiny_model_dir(name)
        model_config = ModelConfig.from_model_path(model_dir)
        for tp in (1, 2, 3):
            with torch.device("meta"):
                cls = model_class(model_config.architecture)
                model = cls(model_config, Communicator(None, 0, tp), torch.float32, 64)
            built = sum(p.numel() for p in model.parameters())
            assert weight_elements_per_rank(load_hf_config(model_dir), tp, []) == built, (name, tp)


def test_cpu_plans_count_float32_weights_the_kv_cache_and_every_rank_in_host_memory():
    cpu = dict(device="cpu", host_memory_gb=64.0, kv_cache_memory_gb=2.0)
    p = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=2, max_model_len=8192, **cpu))
    dense = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=2, gpu_memory_gb=80))
    # float32 (4 bytes) plus the bfloat16 checkpoint's compact copy for decode steps (2 bytes)
    assert p.weight_bytes == dense.weight_bytes // 2 * 6
    assert p.kv_bytes_per_token == 2 * 32 * 4 * 128 * 4 and p.kv_budget_bytes == 2 * GIB
    assert p.overhead_bytes < dense.overhead_bytes, "no CUDA graphs on CPUs"
    assert p.host_needed_bytes == 2 * (p.weight_bytes + p.overhead_bytes + 2 * GIB)
    assert p.fits is True
    short = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=2, max_model_len=8192, **{**cpu, "host_memory_gb": 55}))
    assert short.fits is False and "under the floor of 6 GiB" in short.reasons[0]
    small_kv = plan(LLAMA3_8B, PlanRequest(tensor_parallel_size=2, max_model_len=8192,
                                           **{**cpu, "kv_cache_memory_gb": 0.5}))
    assert small_kv.fits is False and "--kv-cache-memory" in small_kv.reasons[0]


def test_plan_on_a_machine_without_a_gpu_plans_for_cpus(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": 2}))
    result = subprocess.run([sys.executable, "-m", "shardserve", "plan", str(config), "-tp", "2", "--device", "cpu",
                             "--host-memory-gb", "64"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "CPU: float32, in host memory" in result.stdout and "CUDA graphs" not in result.stdout
    assert "fits: yes" in result.stdout


def test_a_quantized_checkpoint_is_planned_as_it_is_held_and_an_unsupported_one_refused(tmp_path):
    """On GPUs the projections stay packed (FP8: a byte a weight plus a float32 scale per 128-wide block; 4-bit
    GPTQ: half a byte plus a float32 scale and zero point per group); on CPUs they are held dequantized."""
    projections = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)  # Llama-3-8B's, at TP 1
    fp8 = {**LLAMA3_8B, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    gptq = {**LLAMA3_8B, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    dense = plan(LLAMA3_8B, PlanRequest(gpu_memory_gb=80))
    quantized = plan(fp8, PlanRequest(gpu_memory_gb=80))
    assert quantized.weight_bytes == dense.weight_bytes - int(projections * (2 - 1 - 4 / 128))
    assert any("fp8 (blocks of 128x128)" in w and "1.03 bytes a weight" in w for w in quantized.warnings)
    # Batches dequantize a packed layer into a 16-bit copy the CUDA graphs keep: the gate/up pair at the most.
    assert quantized.overhead_bytes == dense.overhead_bytes + 2 * 14336 * 4096 * 2
    assert plan(gptq, PlanRequest(gpu_memory_gb=80)).weight_bytes == \
        dense.weight_bytes - int(projections * (2 - 0.5 - 4 / 128))
    online = plan(LLAMA3_8B, PlanRequest(gpu_memory_gb=80, quantization="fp8"))
    assert online.weight_bytes == dense.weight_bytes - int(projections * (1 - 4 / 4096))
    on_cpu = plan(fp8, PlanRequest(device="cpu"))
    assert on_cpu.weight_bytes == plan(LLAMA3_8B, PlanRequest(device="cpu")).weight_bytes
    assert any("held dequantized" in w for w in on_cpu.warnings)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA3_8B, "quantization_config": {"quant_method": "awq", "bits": 4}}))
    result = subprocess.run([sys.executable, "-m", "shardserve", "plan", str(config), "--gpu-memory-gb", "80"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("shardserve plan: error: quantization method 'awq'") and "Traceback" not in \
        result.stderr, result.stderr


def test_a_quantized_mixture_of_experts_counts_its_experts_packed_where_the_slices_hold_whole_groups():
    """Qwen3-30B-A3B-FP8 (blocks of 128): its experts at a byte a weight plus a float32 scale a block on each rank
    at TP 1 and 2 (768 and 384 expert features: whole blocks); at TP 4 the 192 features a rank holds split a block,
    so the experts are counted in bf16, as the engine then holds them. GPTQ in groups of 128 likewise at half a
    byte plus a scale and a zero point a group."""
    fp8 = {**QWEN3_MOE, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    gptq = {**QWEN3_MOE, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    attn = 2048 * (32 + 8) * 128 + 32 * 128 * 2048  # the packed projections at TP 1 (no dense MLP layers)
    for tp in (1, 2):
        dense = plan(QWEN3_MOE, PlanRequest(tensor_parallel_size=tp)).weight_bytes
        projections = 48 * (2048 * (32 // tp + 2 * 4 // tp) * 128 + 32 // tp * 128 * 2048)
        experts = 48 * 128 * 3 * 2048 * 768 // tp
        quantized = plan(fp8, PlanRequest(tensor_parallel_size=tp))
        assert quantized.weight_bytes == dense - int(projections * (1 - 4 / 128)) - int(experts * (1 - 4 / 128))
        assert any("projections and experts" in w for w in quantized.warnings)
        assert plan(gptq, PlanRequest(tensor_parallel_size=tp)).weight_bytes == \
            dense - int(projections * (1.5 - 4 / 128)) - int(experts * (1.5 - 4 / 128))
    assert projections * 2 == 48 * attn
    dense4 = plan(QWEN3_MOE, PlanRequest(tensor_parallel_size=4)).weight_bytes
    four = plan(fp8, PlanRequest(tensor_parallel_size=4))
    assert four.weight_bytes == dense4 - int(48 * (2048 * 10 * 128 + 8 * 128 * 2048) * (1 - 4 / 128))
    assert any("experts, embeddings" in w for w in four.warnings)


@pytest.mark.parametrize("args", [["--rows", "64"], ["--rows", "256", "--logprobs", "5", "--penalty"]])
def test_the_planner_covers_a_sampling_step_at_its_peak(args):
    """Measured in a fresh process: one top-p step over [rows, 152064] float32 logits (of 64 rows; of 256 with
    logprobs and penalties, drawn and penalized 64 rows at a time) grows the peak resident memory by no more than
    the planner reserves beyond the logits themselves."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "sampler_memory.py")
    out = json.loads(subprocess.run([sys.executable, script, "--top-p", "0.9", *args], capture_output=True, text=True,
                                    timeout=120, check=True).stdout)
    assert 8 < out["peak_bytes_per_logit"] <= out["planned_bytes_per_logit"], out


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
               "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
               "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 129280, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                                     "mscale": 1.0, "mscale_all_dim": 1.0,
                                                     "original_max_position_embeddings": 4096}}


@pytest.mark.parametrize("tp", [1, 8])
def test_deepseek_v3_plans_a_latent_cache_replicated_on_every_rank(tp):
    """671B: one [latent 512 | rope key 64] entry a token a layer in bfloat16 at any TP, about 671e9 parameters at
    TP 1 (the multi-token-prediction layer not served), the note that the latent cache is on every rank."""
    p = plan(DEEPSEEK_V3, PlanRequest(tensor_parallel_size=tp, max_model_len=4096, gpu_memory_gb=141))
    assert p.kv_bytes_per_token // 61 == (512 + 64) * 2 and p.latent_cache
    assert any("latent cache is replicated on every rank" in w for w in p.warnings)
    from shardserve.planner import describe

    assert "the latent cache, replicated on every rank" in describe(p, tp)
    if tp == 1:
        assert 660e9 < p.weight_bytes / 2 < 680e9
    cpu = plan(DEEPSEEK_V3, PlanRequest(tensor_parallel_size=tp, device="cpu"))
    assert cpu.kv_bytes_per_token == 61 * 576 * 4


# Kimi-K2 (1T parameters, 32B active): the DeepSeek-V3 architecture with 384 experts in one group, 64 heads and one
# dense layer.
KIMI_K2 = {**DEEPSEEK_V3, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
           "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
           "vocab_size": 163840, "rope_theta": 50000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("config", [DEEPSEEK_V3, KIMI_K2], ids=["deepseek-v3", "kimi-k2"])
def test_deepseek_v3_weights_are_what_a_dummy_build_holds(tp, config):
    """A 5-layer copy of the 671B config (3 dense layers, 2 of experts), and of Kimi-K2's (1 dense, 4 of experts),
    built on the meta device as the engine builds it on rank 0 (routers in float32): the planned bytes within 5%,
    and its elements exactly; the latent cache one entry of 576 a token a layer."""
    import torch

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from shardserve.planner import weight_elements_per_rank

    cfg = {**config, "num_hidden_layers": 5}
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(ModelConfig.from_hf_dict(cfg), Communicator(None, 0, tp), torch.bfloat16, 64)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_elements_per_rank(cfg, tp, []) == sum(p.numel() for p in model.parameters())
    planned = plan(cfg, PlanRequest(tensor_parallel_size=tp))
    assert abs(planned.weight_bytes - built) / built < 0.05
    assert planned.kv_bytes_per_token == 5 * (512 + 64) * 2


def test_deepseek_v3_in_two_pipeline_stages_plans_each_stages_layers_and_latent_cache():
    """-tp 8 -pp 2 (two 8-GPU nodes): each stage's weights about half the model's, and its latent cache one entry
    of 576 bf16 features a token for each of its own layers."""
    whole = plan(DEEPSEEK_V3, PlanRequest(tensor_parallel_size=8, max_model_len=4096, gpu_memory_gb=141))
    staged = plan(DEEPSEEK_V3, PlanRequest(tensor_parallel_size=8, pipeline_parallel_size=2, max_model_len=4096,
                                           gpu_memory_gb=141))
    (first, last), (second_first, second_last) = [s["layers"] for s in staged.stages]
    assert (first, second_last) == (0, 60) and second_first == last + 1
    for s in staged.stages:
        layers = s["layers"][1] - s["layers"][0] + 1
        assert s["kv_bytes_per_token"] == layers * 576 * 2
    assert abs(sum(s["weight_bytes"] for s in staged.stages) - whole.weight_bytes) / whole.weight_bytes < 0.01
