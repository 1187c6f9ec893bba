"""GPU benchmark suite: decode speed against the memory-bandwidth roofline, offline throughput against
Hugging Face transformers, scaling over tensor-parallel sizes and bf16 agreement between them, and the
offline TP=1 workload served over HTTP (`shardserve serve` measured by `shardserve bench`), on a
Llama-3-8B- or Llama-3-70B-shaped model with random bf16 weights (speed does not depend on the values).

    python benchmarks/gpu_suite.py                          # 8B at TP 1, 2, 4, 8 as the GPUs allow, HF, online
    python benchmarks/gpu_suite.py --skip-hf --tp 1
    python benchmarks/gpu_suite.py --model llama3-70b --tp 4,8
    python benchmarks/gpu_suite.py --phase online           # the online phase alone; prints its RESULT line
    python benchmarks/gpu_suite.py --tp 1 --skip-hf --quantization fp8        # --quantization fp8 at load
    python benchmarks/gpu_suite.py --tp 1 --skip-hf --quantization gptq-int4  # a 4-bit GPTQ config, groups of 128
    python benchmarks/gpu_suite.py --tp 1 --skip-hf --quantization gptq-int4-head  # the same with lm_head: true
    python benchmarks/gpu_suite.py --model qwen3-next-80b-a3b --tp 2 --skip-online --long-prompt 32768
    python benchmarks/gpu_suite.py --tp 1 --skip-hf --skip-online --kv-cache-dtype fp8 --long-prompt 131072
    python benchmarks/gpu_suite.py --tp 1 --pp 2 --skip-hf --skip-online   # two pipeline stages (beside --tp 2)

Each phase runs in its own process (a crash or hang in one cannot take the others down); the parent
prints a table and writes benchmarks/results/<device-kind>[-<model>]-<YYYYMMDD>.json (no model part for
the 8B shape).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# Qwen3-Next-80B-A3B: 36 Gated DeltaNet layers and 12 gated attention layers (every fourth), 512 experts of which
# 10 and a shared one a token.
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "partial_rotary_factor": 0.25, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)],
    "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 262144, "rope_theta": 10000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
# NVIDIA-Nemotron-3-Nano-30B-A3B: 23 Mamba-2, 23 mixture-of-experts and 6 attention layers; 128 non-gated experts of
# 1856 features, 6 a token, and a shared expert of 3712.
NEMOTRON_3_NANO_30B_A3B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_hidden_layers": 52,
    "intermediate_size": 1856, "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
    "conv_kernel": 4, "chunk_size": 128, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 131072, "max_position_embeddings": 262144,
    "layer_norm_epsilon": 1e-5, "mlp_hidden_act": "relu2", "mlp_bias": False, "use_bias": False,
    "use_conv_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2,
}
# Moonlight-16B-A3B: the DeepSeek-V3 architecture at 16B parameters, 3B active: latent attention (no q_lora_rank),
# a dense first layer, then 64 routed experts of which 6 a token and two shared ones.
MOONLIGHT_16B_A3B = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
    "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "vocab_size": 163840, "max_position_embeddings": 8192, "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
    "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 163584, "eos_token_id": 163585,
}
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "qwen3-30b-a3b": QWEN3_30B_A3B,
          "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B, "nemotron3-nano-30b-a3b": NEMOTRON_3_NANO_30B_A3B,
          "moonlight-16b-a3b": MOONLIGHT_16B_A3B}
# Families whose bytes are counted on the model shardserve builds (on the meta device), not by formula.
BUILT_MODEL_BYTES = ("nemotron_h", "deepseek_v3")
# --quantization: the tag of its result keys, and bytes a projection weight takes (int4: half a byte plus a
# 32-bit scale-and-zero word per group of 128).
# gptq-int4-head: the same checkpoint with `lm_head: true` (GPTQModel's and AutoRound's option), the head in 4 bits.
# fp8-block: an FP8 checkpoint with 128 x 128 scale blocks (the format of Qwen's and DeepSeek's FP8 releases; a
# float32 scale per row and 128 columns once loaded).
# nvfp4: a ModelOpt NVFP4 checkpoint (e2m1 codes, an e4m3 scale a 16 weights, a global scale), the head 16-bit.
# nvfp4-nvidia: the same as NVIDIA ships its Nemotron-3 checkpoints, the attention layers and the Mamba-2 layers before
# them 16-bit too (named in exclude_modules).
QUANTIZATION_TAGS = {"fp8": "fp8", "fp8-block": "fp8_block", "gptq-int4": "int4", "gptq-int4-head": "int4_head",
                     "nvfp4": "nvfp4", "nvfp4-nvidia": "nvfp4_nvidia"}
LINEAR_WEIGHT_BYTES = {None: 2.0, "fp8": 1.0, "fp8-block": 1 + 4 / 128, "gptq-int4": 0.5 + 4 / 128,
                       "gptq-int4-head": 0.5 + 4 / 128}
GPTQ_INT4 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"}
GPTQ_CONFIGS = {"gptq-int4": GPTQ_INT4, "gptq-int4-head": {**GPTQ_INT4, "lm_head": True}}
# Quantized checkpoints (dummy weights in their config's format): their experts are packed too, where
# --quantization fp8 (at load) packs the projections only.
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
# nvfp4-nvidia: NVFP4 with the model's own exclusions added (checkpoint_config).
CHECKPOINT_CONFIGS = {**GPTQ_CONFIGS, "fp8-block": FP8_BLOCK, "nvfp4": NVFP4, "nvfp4-nvidia": NVFP4}
OFFLINE_REQUESTS, OFFLINE_PROMPT, OFFLINE_OUTPUT = 512, 512, 256
HF_BATCH = 64
AGREE_PROMPTS, AGREE_TOKENS = 32, 16
DECODE_PROMPT = 128
DECODE_REPEATS, OFFLINE_REPEATS = 5, 3
# Online: the offline workload at these concurrencies, after a short batch-1 run for the per-token latency.
ONLINE_LEVELS = (64, 256, 512)
ONLINE_C1_REQUESTS = 16
ONLINE_HEALTH_TIMEOUT_S = 600
ONLINE_STOP_GRACE_S = 60
# The online phase's stdout names the session of each server it starts, and again once that server is
# stopped: run_phase kills any left running (a phase killed on a hang never reaches its own clean-up).
SERVER_STARTED, SERVER_STOPPED = "SERVER_SESSION ", "SERVER_STOPPED "


def nvidia_nvfp4_exclusions(pattern: str) -> list[str]:
    """The modules NVIDIA's NVFP4 Nemotron-3 checkpoints leave in bf16 (their exclude_modules), for a NemotronH
    hybrid_override_pattern: the head, each attention layer's projections and the in_proj and out_proj of the
    Mamba-2 layer before it."""
    kept = ["lm_head"]
    for i, kind in enumerate(pattern):
        if kind == "*":
            kept += [f"backbone.layers.{i}.mixer.{p}_proj" for p in "qkvo"]
            if i and pattern[i - 1] == "M":
                kept += [f"backbone.layers.{i - 1}.mixer.in_proj", f"backbone.layers.{i - 1}.mixer.out_proj"]
    return kept


def checkpoint_config(quantization: str, shape: dict) -> dict:
    """The quantization_config of a `quantization` checkpoint of `shape` (CHECKPOINT_CONFIGS)."""
    if quantization == "nvfp4-nvidia":
        if "hybrid_override_pattern" not in shape:
            raise SystemExit("--quantization nvfp4-nvidia: NVIDIA's layout of a NemotronH checkpoint (a "
                             "hybrid_override_pattern), not of this model")
        return {**NVFP4, "exclude_modules": nvidia_nvfp4_exclusions(shape["hybrid_override_pattern"])}
    return CHECKPOINT_CONFIGS[quantization]


def graph_replay_ms(graph, replays: int = 50) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def weight_bytes(cfg: dict, active: bool = False, quantization: str | None = None) -> int:
    """bf16 bytes of the weights (embedding and untied head included); `active`: those one decoded token reads,
    for a mixture of experts its router and its num_experts_per_tok chosen experts a layer (and the shared
    expert), not all of them, and for a hybrid the recurrent states its linear-attention layers read and write;
    `quantization`: the attention and MLP projections in that format (LINEAR_WEIGHT_BYTES), and the experts too
    for a quantized checkpoint (CHECKPOINT_CONFIGS).
    (The roofline counts one embedding row as the whole embedding, a rounding error beside the head.)"""
    if cfg["model_type"] in BUILT_MODEL_BYTES:
        if quantization and quantization not in CHECKPOINT_CONFIGS:
            raise SystemExit(f"{cfg['model_type']}: the roofline counts a quantized checkpoint's packed weights, "
                             f"not {quantization} at load")
        if quantization in CHECKPOINT_CONFIGS:
            cfg = {**cfg, "quantization_config": checkpoint_config(quantization, cfg)}
        return built_model_bytes(cfg, active)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    gated = 2 if cfg["model_type"] == "qwen3_next" else 1  # Qwen3-Next's q_proj also holds the output gate
    attention = h * (gated * q + 2 * kv) + q * h
    projections = per_layer = 0
    for kind in types:
        projections += attention if kind == "full_attention" else _delta_net_projections(cfg)
        per_layer += 2 * h
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        used = cfg["num_experts_per_tok"] if active else experts
        shared = cfg.get("shared_expert_intermediate_size", 0)
        # Routers and the shared expert's gate stay 16-bit; the shared expert is packed as the projections are,
        # the routed experts only in a quantized checkpoint.
        routed = len(types) * used * 3 * h * cfg["moe_intermediate_size"]
        per_layer += len(types) * (experts * h + (h if shared else 0))
        projections += len(types) * 3 * h * shared
        if quantization in CHECKPOINT_CONFIGS:
            projections += routed
        else:
            per_layer += routed
    else:
        projections += len(types) * 3 * h * cfg["intermediate_size"]
    linear = LINEAR_WEIGHT_BYTES[quantization] * projections
    head_packed = GPTQ_CONFIGS.get(quantization, {}).get("lm_head", False)
    head = (LINEAR_WEIGHT_BYTES[quantization] if head_packed else 2) * v * h
    linear_layers = sum(kind == "linear_attention" for kind in types)
    states = linear_layers * _delta_net_state_bytes(cfg) if active and linear_layers else 0
    return int(linear + head + 2 * (per_layer + v * h + h) + states)


def built_model_bytes(cfg: dict, active: bool) -> int:
    """Bytes of the model shardserve builds from `cfg` at TP 1 (on the meta device; bf16, routers float32; a
    quantized checkpoint's layers and experts packed as the engine packs them, codes and scales); `active`: of
    stacked experts (a 3-dimensional parameter whose first axis is the expert count, or their row scales) only
    num_experts_per_tok,
    plus the per-sequence states (pools of one slot) a decoded token reads and writes once each."""
    import torch

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers.linear import deferred_weights
    from shardserve.layers.moe_packed import pack_experts
    from shardserve.layers.quantization.packed import PackedLayout
    from shardserve.layers.quantization.selection import pack_layers
    from shardserve.models.registry import model_class
    from shardserve.weights.loader import configured_quantized_modules

    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        model_config = ModelConfig.from_model_path(path)
    scheme = model_config.quantization
    with torch.device("meta"), deferred_weights():
        model = model_class(model_config.architecture)(model_config, Communicator(None, 0, 1), torch.bfloat16,
                                                       max_positions=4096)
    if scheme is not None:
        layout, names = PackedLayout.of_checkpoint(scheme), configured_quantized_modules(model, scheme)
        pack_layers(model, names, layout, "meta", log=False, head=scheme.lm_head)
        pack_experts(model, names, layout, "meta", log=False)
    else:
        pack_layers(model, set(), PackedLayout("fp8", 0), "meta", log=False)  # every layer its dense weight
        pack_experts(model, set(), PackedLayout("fp8", 0), "meta", log=False)
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        stacked = p.dim() == 3 or name.endswith("_row_scale")  # experts' weights, scales and row scales ([E, N])
        if active and experts and stacked and p.shape[0] == experts:
            n = n * cfg["num_experts_per_tok"] // experts
        total += n
    if active:
        pools = model.state_pools(1, torch.device("meta")).values()
        total += 2 * sum(t.numel() * t.element_size() for pool in pools for t in pool)
    return total


def _delta_net_projections(cfg: dict) -> int:
    """Weights of a Gated DeltaNet layer's projections: in_proj_qkvz, in_proj_ba, out_proj."""
    h, keys = cfg["hidden_size"], cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    values, heads = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"], cfg["linear_num_value_heads"]
    return h * (2 * keys + 2 * values) + h * 2 * heads + values * h


def _delta_net_state_bytes(cfg: dict) -> int:
    """Bytes a decoded token reads and writes of one Gated DeltaNet layer's state: the float32 delta-rule matrices
    and the bf16 convolution inputs, each read once and written once."""
    keys = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    values = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    matrices = cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4
    conv = (2 * keys + values) * (cfg["linear_conv_kernel_dim"] - 1) * 2
    return 2 * (matrices + conv)


def write_model_dir(path: str, shape: dict = LLAMA3_8B) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(shape, f)
    # Benchmarks feed token ids; a word-level tokenizer over the whole vocabulary stands in for the real one.
    # The whitespace pre-tokenizer makes text prompts (HTTP benchmarks) count one token a word, not one in all.
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t128001", "unk_token": "t0"}, f)
    return path


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128000, (n, length), generator=g).tolist()


# -- phases (each in its own process) ----------------------------------------------------------
def copy_rate_GBps() -> float:
    """The card's copy rate, the rooflines' bandwidth: bytes read and written by torch's copy of 4 GiB, eagerly (a
    copy captured in a CUDA graph runs slower)."""
    import torch

    nbytes = 4 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t) / 1e9


def phase_roofline(args) -> dict:
    import torch

    bw = copy_rate_GBps()
    wb = weight_bytes(SHAPES[args.model], quantization=args.quantization)
    active = weight_bytes(SHAPES[args.model], active=True, quantization=args.quantization)
    return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "copy_GBps": bw, "weight_bytes": wb, "active_weight_bytes": active, "roofline_tok_s": bw * 1e9 / active}


def phase_hf(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    out = {}
    with torch.inference_mode():
        def generate(ids, n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        one = torch.tensor(random_prompts(1, DECODE_PROMPT, 5), device="cuda")
        generate(one, 4)
        out["hf_decode_bs1_tok_s"] = 48 / (generate(one, 64) - generate(one, 16))
        batch = torch.tensor(random_prompts(HF_BATCH, OFFLINE_PROMPT, 6), device="cuda")
        seconds = generate(batch, OFFLINE_OUTPUT)
        out["hf_offline_output_tok_s"] = HF_BATCH * OFFLINE_OUTPUT / seconds
        out["hf_offline_batch"] = HF_BATCH
    return out


def phase_engine(args) -> dict:
    import torch

    from shardserve.entrypoints.llm import LLM
    from shardserve.requests.sampling_params import SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model_dir, tensor_parallel_size=args.tp[0], pipeline_parallel_size=args.pp, device="cuda",
              dtype="bfloat16", load_format="dummy",
              max_model_len=max(2048, args.long_prompt + 16), max_num_seqs=OFFLINE_REQUESTS,
              max_num_batched_tokens=args.max_batched_tokens,
              quantization="fp8" if args.quantization == "fp8" else None, kv_cache_dtype=args.kv_cache_dtype)
    out = {"startup_s": time.perf_counter() - started, "kv_cache_blocks": llm.engine.runner.num_blocks,
           "pipeline_parallel_size": args.pp,
           "kv_cache_dtype": args.kv_cache_dtype,
           "kernel_plan": llm.engine.runner.plan.describe()}
    runner = llm.engine.runner
    if runner.all_reduce_choice is not None:
        out["allreduce_choice"] = runner.all_reduce_choice.describe()
        out["allreduce_timings_us"] = {k: {str(n): round(us, 2) for n, us in t.items()}
                                       for k, t in runner.all_reduce_choice.timings_us.items()}

    def run(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        results = llm.generate(prompts, params)
        torch.cuda.synchronize()
        return time.perf_counter() - t, results

    prompt = random_prompts(1, DECODE_PROMPT, 5)
    run(prompt, 8)  # warm up (and fill the prefix cache, so both timed runs skip the same prefill)
    samples = []
    for _ in range(DECODE_REPEATS):  # run-to-run spread is a few percent: report the median and every sample
        short, _ = run(prompt, 32)
        long, _ = run(prompt, 288)
        samples.append(256 / (long - short))
    out["decode_bs1_tok_s"] = statistics.median(samples)
    out["decode_bs1_samples"] = samples
    if runner.graphs is not None and args.tp[0] == 1 and args.pp == 1:  # the device's share of a step: the graph
        # replayed alone (one rank only: with several, a graph replayed on rank 0 alone would wait in its
        # all-reduce for ranks that never join)
        out["decode_bs1_graph_replay_ms"] = graph_replay_ms(runner.graphs.decode_graph(1))

    _, agree = run(random_prompts(AGREE_PROMPTS, 64, 9), AGREE_TOKENS)
    out["agreement_tokens"] = [r.token_ids for r in agree]

    if args.long_prompt:  # one long prompt's prefill (and its first token), after one of the same length
        seconds = [run(random_prompts(1, args.long_prompt, 50 + i), 1)[0] for i in range(2)]
        out["long_prompt_tokens"], out["long_prompt_prefill_s"] = args.long_prompt, seconds[1]
    rates = []
    if args.offline_repeats:
        run(random_prompts(32, 256, 10), 32)  # warm up prefill shapes
    for i in range(args.offline_repeats):
        prompts = random_prompts(OFFLINE_REQUESTS, OFFLINE_PROMPT, 11 + i)  # fresh prompts: no prefix-cache hits
        seconds, results = run(prompts, OFFLINE_OUTPUT)
        produced = sum(len(r.token_ids) for r in results)
        assert produced == OFFLINE_REQUESTS * OFFLINE_OUTPUT, f"produced {produced} tokens"
        rates.append(produced / seconds)
    out["offline_output_tok_s"] = statistics.median(rates) if rates else None
    out["offline_samples"] = rates
    out["preemptions"] = llm.engine.scheduler.num_preemptions
    # Report before shutting down: a teardown that hangs must not lose the measurements.
    print("RESULT " + json.dumps(out), flush=True)
    llm.shutdown()
    return out


# -- the online phase: the offline workload served over HTTP -------------------------------------
# Its parts take the device, sizes and counts as parameters, so that they run on CPU with a tiny model too.
log = logging.getLogger("gpu_suite.online")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int, log_path: str, *, name: str, device: str = "cuda",
                 dtype: str = "bfloat16", max_num_seqs: int = OFFLINE_REQUESTS, max_batched_tokens: int = 8192,
                 max_model_len: int = 2048, api_server_count: int | None = None,
                 extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """`shardserve serve` with dummy weights in its own session, its stdout and stderr in `log_path`."""
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", model_dir, "--load-format", "dummy", "--device", device,
           "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_batched_tokens),
           "--max-model-len", str(max_model_len), "--served-model-name", name, "--host", "127.0.0.1",
           "--port", str(port), *extra_args]
    if api_server_count is not None:  # otherwise the server's default applies
        cmd += ["--api-server-count", str(api_server_count)]
    log.info("online: starting %s", " ".join(cmd))
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    print(f"{SERVER_STARTED}{proc.pid}", flush=True)
    return proc


def log_tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str, timeout: float = ONLINE_HEALTH_TIMEOUT_S) -> float:
    """Seconds until GET /health answered 200; RuntimeError (with the server's log tail) when the server exits
    first or `timeout` passes."""
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before /health answered 200; "
                               f"its output ends:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"/health did not answer 200 within {timeout:.0f} s; the server's output ends:\n"
                               f"{log_tail(log_path)}")
        time.sleep(1)


def stop_server(proc: subprocess.Popen, grace: float = ONLINE_STOP_GRACE_S) -> str:
    """SIGINT, then SIGKILL to the server's whole session if it has not exited within `grace` seconds; how it
    ended, in words. Every process left in the session is killed either way."""
    how = "exited before it was stopped"
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace)
            how = f"stopped on SIGINT (status {proc.returncode})"
        except subprocess.TimeoutExpired:
            how = f"killed: still running {grace:.0f} s after SIGINT"
    _signal_session(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"{SERVER_STOPPED}{proc.pid}", flush=True)
    return how


def session_cpu_by_process(sid: int) -> dict[str, float]:
    """User + system CPU seconds of every live process in session `sid`, with the children they reaped, by
    process name (/proc/PID/comm: the engine core is python3, front ends shardserve-api<i>, ranks shardserve-r<i>)."""
    seconds: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                comm, _, rest = f.read().partition(" (")[2].rpartition(")")
                fields = rest.split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        # cutime cstime ...
        if int(fields[3]) == sid:
            ticks = sum(int(v) for v in fields[11:15])
            seconds[comm] = seconds.get(comm, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
    return seconds


def session_cpu_seconds(sid: int) -> float:
    """User + system CPU seconds of every live process in session `sid`, with the children they reaped."""
    return sum(session_cpu_by_process(sid).values())


def start_profilers(sid: int, out_dir: str, delay_s: int = 4, duration_s: int = 10) -> list:
    """py-spy (when installed) on every process of session `sid`, `delay_s` from now for `duration_s`, as raw
    folded stacks in out_dir/<name>-<pid>.raw: where each process of the server spends a loaded level."""
    spy = shutil.which("py-spy")
    if spy is None:
        log.warning("online: py-spy is not installed; no profiles")
        return []
    os.makedirs(out_dir, exist_ok=True)
    procs = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                comm, _, rest = f.read().partition(" (")[2].rpartition(")")
            if not entry.isdigit() or int(rest.split()[3]) != sid:
                continue
        except (OSError, IndexError, ValueError):
            continue
        raw = os.path.join(out_dir, f"{comm}-{entry}.raw")
        cmd = f"sleep {delay_s}; exec {spy} record -r 100 -d {duration_s} --nonblocking -f raw -o {raw} -p {entry}"
        with open(raw.removesuffix(".raw") + ".log", "w") as spy_log:
            procs.append(subprocess.Popen(["bash", "-c", cmd], stdout=spy_log, stderr=subprocess.STDOUT))
    return procs


def bench_level(url: str, name: str, tokenizer_dir: str, concurrency: int, num_prompts: int, prompt_len: int,
                output_len: int, seed: int, out_path: str, timeout: float = 3600) -> dict:
    """One `shardserve bench` level; its JSON summary. Prompts are built with the model's tokenizer, so each is
    exactly `prompt_len` tokens, and the server's count of them is checked (RuntimeError when it differs, when
    a request failed or when fewer than num_prompts x output_len tokens came back)."""
    cmd = [sys.executable, "-m", "shardserve.cli", "bench", "--base-url", url, "--model", name,
           "--concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--input-len", str(prompt_len),
           "--output-len", str(output_len), "--tokenizer", tokenizer_dir, "--seed", str(seed), "--out", out_path]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)
    record = None
    if os.path.exists(out_path):
        with open(out_path) as f:
            record = json.load(f)
    where = f"online c{concurrency}"
    if record is not None and record.get("prompt_length_warning"):
        raise RuntimeError(f"{where}: the server counted other prompt lengths than the {prompt_len} tokens sent, "
                           f"so the figures would describe another workload: {record['prompt_length_warning']}")
    if run.returncode != 0 or record is None:
        raise RuntimeError(f"{where}: shardserve bench exited with status {run.returncode}; its output ends:\n"
                           f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    level = record["levels"][0]
    if level["completed"] != num_prompts or level["total_output_tokens"] != num_prompts * output_len:
        raise RuntimeError(f"{where}: {level['completed']} of {num_prompts} requests completed with "
                           f"{level['total_output_tokens']} output tokens, not {num_prompts * output_len}")
    return level


def run_online(model_dir: str, *, name: str = "llama3-8b", device: str = "cuda", dtype: str = "bfloat16",
               tp: int = 1, max_batched_tokens: int = 8192, max_model_len: int = 2048, max_num_seqs: int = OFFLINE_REQUESTS,
               requests: int = OFFLINE_REQUESTS, prompt_len: int = OFFLINE_PROMPT, output_len: int = OFFLINE_OUTPUT,
               levels: tuple[int, ...] = ONLINE_LEVELS, c1_requests: int = ONLINE_C1_REQUESTS,
               api_server_count: int | None = None, extra_serve_args: tuple[str, ...] = (),
               health_timeout: float = ONLINE_HEALTH_TIMEOUT_S, work_dir: str | None = None,
               profile_dir: str | None = None) -> dict:
    """Serve `model_dir` (dummy weights) over HTTP at tensor-parallel size `tp` and measure it with `shardserve
    bench`: `c1_requests` at
    concurrency 1 (per-token latency), then `requests` at each of `levels`, all of `prompt_len` prompt tokens
    and `output_len` output tokens (ignore_eos). Keys: online_c<N>_output_tok_s, online_c<N>_tpot_ms and
    online_c<N>_ttft_ms (p50) for N = 1 and each level, online_c<largest>_server_cpu_s (the server's processes'
    CPU seconds during that level; by process in online_c<largest>_cpu_s_by_process, the bench client's in
    online_c<largest>_client_cpu_s), online_startup_s and how the server stopped. With `profile_dir`, py-spy
    profiles of the server's processes during the largest level go there."""
    work_dir = work_dir or tempfile.mkdtemp(prefix="gpu-suite-online-")
    os.makedirs(work_dir, exist_ok=True)
    server_log = os.path.join(work_dir, "server.log")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out: dict = {"online_server_log": server_log}
    proc = start_server(model_dir, port, server_log, name=name, device=device, dtype=dtype,
                        max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens, max_model_len=max_model_len,
                        api_server_count=api_server_count, extra_args=("-tp", str(tp), *extra_serve_args))
    try:
        out["online_startup_s"] = wait_healthy(proc, url, server_log, health_timeout)
        log.info("online: %s healthy after %.0f s", url, out["online_startup_s"])
        plan = [(1, c1_requests)] + [(c, requests) for c in levels]
        largest = max(levels, default=None)
        for i, (concurrency, count) in enumerate(plan):
            measured = concurrency == largest
            if measured:
                before = session_cpu_by_process(proc.pid)
                profilers = start_profilers(proc.pid, profile_dir) if profile_dir else []
            # A seed per level: no prompt shares a prefix with another level's (or the warm-up's).
            level = bench_level(url, name, model_dir, concurrency, count, prompt_len, output_len, seed=1000 + i,
                                out_path=os.path.join(work_dir, f"bench-c{concurrency}.json"))
            if measured:
                after = session_cpu_by_process(proc.pid)
                by_process = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
                out[f"online_c{concurrency}_server_cpu_s"] = sum(by_process.values())
                out[f"online_c{concurrency}_cpu_s_by_process"] = by_process
                out[f"online_c{concurrency}_client_cpu_s"] = level.get("client_cpu_s")  # the bench process's own
                for p in profilers:
                    p.wait(timeout=60)
            out[f"online_c{concurrency}_output_tok_s"] = level["output_throughput"]
            out[f"online_c{concurrency}_tpot_ms"] = level["tpot_ms"]["p50"] if level["tpot_ms"] else None
            out[f"online_c{concurrency}_ttft_ms"] = level["ttft_ms"]["p50"] if level["ttft_ms"] else None
            out[f"online_c{concurrency}_duration_s"] = level["duration_s"]
            log.info("online: concurrency %d, %d requests: %.1f output tok/s, TPOT p50 %.2f ms", concurrency,
                     count, level["output_throughput"], out[f"online_c{concurrency}_tpot_ms"] or float("nan"))
    finally:
        out["online_server_stop"] = stop_server(proc)
        log.info("online: server %s", out["online_server_stop"])
    out["online_workload"] = {"requests": requests, "c1_requests": c1_requests, "prompt_tokens": prompt_len,
                              "output_tokens": output_len, "levels": [1, *levels],
                              "api_server_count": api_server_count, "tensor_parallel_size": tp}
    return out


def phase_online(args) -> dict:
    model_dir = args.model_dir or write_model_dir(tempfile.mkdtemp(prefix=f"{args.model}-shape-"), SHAPES[args.model])
    return run_online(model_dir, name=args.model, device="cuda", tp=args.online_tp,
                      max_batched_tokens=args.max_batched_tokens,
                      api_server_count=args.api_server_count, profile_dir=args.profile_online)


PHASES = {"roofline": phase_roofline, "hf": phase_hf, "engine": phase_engine, "online": phase_online}


def run_phase(name: str, args, extra: list[str], timeout: int) -> dict:
    """Run one phase in a fresh process (and session). On a hang, every process of the phase (its
    spawned ranks too) is sent SIGABRT, which with PYTHONFAULTHANDLER set prints each one's stack."""
    cmd = [sys.executable, __file__, "--phase", name, "--model", args.model, "--model-dir", args.model_dir,
           "--max-batched-tokens", str(args.max_batched_tokens), "--long-prompt", str(args.long_prompt),
           "--offline-repeats", str(args.offline_repeats), "--kv-cache-dtype", args.kv_cache_dtype,
           "--pp", str(args.pp), *extra]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    print(f"== {name} {' '.join(extra)}", flush=True)
    t = time.perf_counter()
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    hung = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        _signal_session(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_session(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
    _signal_session(proc.pid, signal.SIGKILL)  # no rank process outlives its phase
    for server in _servers_left_running(stdout):  # nor a server it started in a session of its own
        print(f"{name}: killing the server it left running (session {server})", flush=True)
        _signal_session(server, signal.SIGKILL)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if hung:
        print(f"{name}: timed out after {timeout} s; stacks:\n{_stacks(stderr)}", flush=True)
        if not lines:
            return {"error": f"timed out after {timeout} s"}
        print(f"{name}: its measurements were reported before the hang; keeping them", flush=True)
    elif proc.returncode != 0 or not lines:
        print(stdout[-2000:], stderr[-6000:], sep="\n", flush=True)
        return {"error": f"exit {proc.returncode}: {stderr.strip().splitlines()[-1:]}"}
    log = [ln for ln in stderr.splitlines() if " INFO " in ln or "WARNING" in ln]
    plan = [ln for ln in log[:-20] if "kernel plan:" in ln or "WARNING" in ln]  # start-up lines worth keeping
    print("\n".join(plan + log[-20:]), flush=True)
    print(f"   ({time.perf_counter() - t:.0f} s)", flush=True)
    return json.loads(lines[-1][len("RESULT "):])


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _servers_left_running(stdout: str) -> list[int]:
    """The sessions of the servers a phase started and did not report stopped."""
    lines = stdout.splitlines()
    started = [int(ln[len(SERVER_STARTED):]) for ln in lines if ln.startswith(SERVER_STARTED)]
    stopped = {int(ln[len(SERVER_STOPPED):]) for ln in lines if ln.startswith(SERVER_STOPPED)}
    return [pid for pid in started if pid not in stopped]


def _stacks(stderr: str) -> str:
    """The log's last lines and the Python stacks faulthandler printed, without library frames."""
    keep = [ln for ln in stderr.splitlines()
            if not ("site-packages/torch/nn/modules" in ln or "/threading.py" in ln or ln.strip().startswith("^"))]
    return "\n".join(keep[-120:])


def device_kind(name: str, gpus: int) -> str:
    model = next((m for m in ("H200", "H100", "A100", "L40S", "GB10") if m in name), name.split()[-1])
    return f"nvidia-{model.lower()}" + (f"-x{gpus}" if gpus > 1 else "")


def commit_id(repo: str = REPO) -> str:
    """What a result was measured at: SHARDSERVE_COMMIT where set (a run on a copy of the tree whose git history is
    not the tree's: name the commit there, SHARDSERVE_COMMIT=$(git rev-parse --short HEAD) from the checkout), else
    HEAD, with "+changes" where tracked files differ from it (so a copy whose HEAD is older says so)."""
    if os.environ.get("SHARDSERVE_COMMIT"):
        return os.environ["SHARDSERVE_COMMIT"]
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                                       stderr=subprocess.DEVNULL).strip()
        changed = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                          text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=sorted(PHASES))
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b", help="the model shape (default llama3-8b)")
    p.add_argument("--tp", type=_sizes, default=None,
                   help="tensor-parallel sizes, e.g. 1,2 (default: every power of two up to the GPU count whose "
                        "share of the weights fits one GPU)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages of every engine run (world size TP x PP; default 1); results file -ppP")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers baseline (only run for llama3-8b)")
    p.add_argument("--online", dest="online", action="store_true", default=None,
                   help="serve the offline TP=1 workload over HTTP and measure it with shardserve bench at "
                        f"concurrency 1 and {', '.join(map(str, ONLINE_LEVELS))} (default: when the TP sizes "
                        "include 1)")
    p.add_argument("--skip-online", dest="online", action="store_false", help="no online phase")
    p.add_argument("--online-tp", type=int, default=1, help="the online phase's tensor-parallel size (default 1)")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="passed on to shardserve serve in the online phase (default: not passed, the server's own)")
    p.add_argument("--profile-online", default=None, metavar="DIR",
                   help="py-spy profiles (raw folded stacks) of the server's processes during the largest online "
                        "level, written to DIR (needs py-spy)")
    p.add_argument("--quantization", choices=sorted(QUANTIZATION_TAGS), default=None,
                   help="fp8: --quantization fp8 at load; gptq-int4: a 4-bit GPTQ checkpoint (groups of 128); "
                        "gptq-int4-head: the same with its LM head quantized (lm_head: true). Results go under keys "
                        "tagged fp8 / int4 / int4_head, added to the day's results file (no HF, no online phase)")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "fp8", "fp8_e4m3"], default="auto",
                   help="the offline phases' KV cache (serve --kv-cache-dtype); fp8 holds twice the tokens of bf16")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--offline-repeats", type=int, default=OFFLINE_REPEATS,
                   help=f"offline runs, the median reported (default {OFFLINE_REPEATS}; 0: none, for a decode "
                        "comparison in about half the time)")
    p.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                   help="also time the prefill of one prompt this long (e.g. 32768; max_model_len grows to fit)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--phase-timeout", type=int, default=900, help="seconds before a phase counts as hung")
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.phase:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        result = PHASES[args.phase](args)
        print("RESULT " + json.dumps(result), flush=True)
        sys.stdout.flush()
        os._exit(0)  # symmetric-memory and NCCL teardown can hang at interpreter exit
    shape = SHAPES[args.model]
    if args.quantization in CHECKPOINT_CONFIGS:
        shape = {**shape, "quantization_config": checkpoint_config(args.quantization, shape)}
    if args.long_prompt > shape["max_position_embeddings"]:
        # A longer context of the same shape (Llama-3.1-8B's is 128k): speed does not depend on the rope tables.
        shape = {**shape, "max_position_embeddings": args.long_prompt + 16}
    if args.quantization:
        args.skip_hf, args.online = True, False
    args.model_dir = args.model_dir or write_model_dir(tempfile.mkdtemp(prefix=f"{args.model}-shape-"), shape)
    report = run_phase("roofline", args, [], 300)
    if "error" in report:
        return 1
    sizes = args.tp or default_sizes(report["gpus"], report["weight_bytes"], report["gpu_memory_bytes"])
    if not sizes:
        print(f"{args.model}: {report['weight_bytes'] / 1e9:.0f} GB of weights fit no tensor-parallel size on "
              f"{report['gpus']} GPU(s) of {report['gpu_memory_bytes'] / 2**30:.0f} GiB; nothing to run")
        return 2
    if not args.skip_hf and args.model == "llama3-8b":  # HF's generate holds the whole model on one GPU
        report.update(run_phase("hf", args, [], args.phase_timeout))
    engines = {tp: run_phase("engine", args, ["--tp", str(tp)], args.phase_timeout) for tp in sizes}
    online = None
    if args.online or (args.online is None and args.online_tp in sizes):
        extra = ["--online-tp", str(args.online_tp)]
        extra += [] if args.api_server_count is None else ["--api-server-count", str(args.api_server_count)]
        extra += [] if args.profile_online is None else ["--profile-online", args.profile_online]
        online = run_phase("online", args, extra, args.phase_timeout)
    results = summarize(report, engines, args.model, online)
    results["pipeline_parallel_size"] = args.pp  # with P > 1, every tpN key is that of TP N x PP P
    print_table(results)
    os.makedirs(args.out, exist_ok=True)
    model = "" if args.model == "llama3-8b" else f"{args.model}-"
    model += f"pp{args.pp}-" if args.pp > 1 else ""
    path = os.path.join(args.out, f"{results['device_kind']}-{model}{datetime.date.today():%Y%m%d}.json")
    if args.quantization:
        earlier = {}
        if os.path.exists(path):
            with open(path) as f:
                earlier = json.load(f)
        results = quantized_results(results, QUANTIZATION_TAGS[args.quantization], earlier)
        print("\n".join(f"{key}: {value}" for key, value in results.items() if key not in earlier))
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(t) for t in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected tensor-parallel sizes like 1,2,4, got {text!r}")
    return sizes


def default_sizes(gpus: int, weight_bytes_total: int, gpu_memory_bytes: int) -> list[int]:
    """Powers of two up to the GPU count whose share of the weights leaves a quarter of a GPU for the rest."""
    return [tp for tp in (1, 2, 4, 8, 16) if tp <= gpus and weight_bytes_total / tp <= 0.75 * gpu_memory_bytes]


def summarize(report: dict, engines: dict[int, dict], model: str = "llama3-8b", online: dict | None = None) -> dict:
    wb = report.get("active_weight_bytes", report["weight_bytes"])  # what a decoded token reads
    res = {"device": report["device"], "device_kind": device_kind(report["device"], report["gpus"]),
           "model_shape": model, "commit": commit_id(), "torch": report["torch"], "copy_GBps": report["copy_GBps"],
           "weight_bytes": report["weight_bytes"], "active_weight_bytes": wb, "roofline_tok_s": report["roofline_tok_s"],
           "hf_decode_bs1_tok_s": report.get("hf_decode_bs1_tok_s"),
           "hf_offline_output_tok_s": report.get("hf_offline_output_tok_s"), "hf_offline_batch": HF_BATCH,
           "workload": {"offline_requests": OFFLINE_REQUESTS, "prompt_tokens": OFFLINE_PROMPT,
                        "output_tokens": OFFLINE_OUTPUT, "decode_prompt_tokens": DECODE_PROMPT}}
    for tp, e in engines.items():
        if "error" in e:
            res[f"tp{tp}_error"] = e["error"]
            continue
        res[f"decode_bs1_tp{tp}_tok_s"] = e["decode_bs1_tok_s"]
        res[f"decode_bs1_tp{tp}_samples"] = e["decode_bs1_samples"]
        if "decode_bs1_graph_replay_ms" in e:
            res[f"decode_bs1_tp{tp}_graph_replay_ms"] = e["decode_bs1_graph_replay_ms"]
        res[f"offline_tp{tp}_samples"] = e["offline_samples"]
        res[f"decode_bs1_tp{tp}_GBps"] = e["decode_bs1_tok_s"] * wb / 1e9
        res[f"offline_tp{tp}_output_tok_s"] = e["offline_output_tok_s"]
        res[f"tp{tp}_startup_s"] = e["startup_s"]
        res[f"tp{tp}_preemptions"] = e["preemptions"]
        if "long_prompt_prefill_s" in e:
            res[f"tp{tp}_prefill_{e['long_prompt_tokens']}_tokens_s"] = e["long_prompt_prefill_s"]
        # Each rank streams 1/tp of the weights: the ideal batch-1 rate is tp times one GPU's.
        res[f"roofline_tp{tp}_tok_s"] = tp * res["roofline_tok_s"]
        res[f"decode_bs1_tp{tp}_fraction_of_roofline"] = e["decode_bs1_tok_s"] / res[f"roofline_tp{tp}_tok_s"]
        if "allreduce_choice" in e:
            res[f"tp{tp}_allreduce_choice"] = e["allreduce_choice"]
            res[f"tp{tp}_allreduce_timings_us"] = e["allreduce_timings_us"]
            if "allreduce_choice" not in res:  # the smallest group's, as before several sizes were run
                res["allreduce_choice"] = e["allreduce_choice"]
                res["allreduce_timings_us"] = e["allreduce_timings_us"]
        if "agreement_tokens" in e:  # kept, so a later run of one TP size can be compared with this one
            res[f"tp{tp}_agreement_tokens"] = e["agreement_tokens"]
    res.setdefault("allreduce_choice", "single GPU: no all-reduce")
    if res.get("hf_offline_output_tok_s") and "offline_tp1_output_tok_s" in res:
        res["offline_tp1_vs_hf"] = res["offline_tp1_output_tok_s"] / res["hf_offline_output_tok_s"]
    if online is not None:
        if "error" in online:
            res["online_error"] = online["error"]
        else:
            res.update({k: v for k, v in online.items() if k != "online_server_log"})
            online_tp = online["online_workload"].get("tensor_parallel_size", 1)
            offline = res.get(f"offline_tp{online_tp}_output_tok_s")
            for c in online["online_workload"]["levels"][1:]:
                if offline and online.get(f"online_c{c}_output_tok_s"):
                    res[f"online_c{c}_vs_offline"] = online[f"online_c{c}_output_tok_s"] / offline
    ran = sorted(tp for tp in engines if "decode_bs1_tok_s" in engines[tp])
    for tp in ran[1:]:  # each size against the smallest: batch-1 speed-up and bf16 agreement
        base = ran[0]
        res[f"decode_bs1_tp{tp}_speedup"] = res[f"decode_bs1_tp{tp}_tok_s"] / res[f"decode_bs1_tp{base}_tok_s"]
        a, b = engines[base].get("agreement_tokens"), engines[tp].get("agreement_tokens")
        if a and b:
            res[f"tp{base}_tp{tp}_bf16_first16_agree_fraction"] = sum(x == y for x, y in zip(a, b)) / len(a)
    return res


def quantized_results(res: dict, tag: str, earlier: dict) -> dict:
    """A quantized run's figures under keys tagged `tag` (decode_bs1_tp1_fp8_tok_s, offline_tp1_fp8_output_tok_s,
    roofline_fp8_tok_s, ...), added to `earlier` (the day's bf16 results, if any), with the ratios to its bf16
    figures where that run is there."""
    out = dict(earlier) or {k: res[k] for k in ("device", "device_kind", "model_shape", "torch", "copy_GBps")}
    out.update({f"commit_{tag}": res["commit"], f"weight_bytes_{tag}": res["weight_bytes"],
                f"active_weight_bytes_{tag}": res["active_weight_bytes"], f"roofline_{tag}_tok_s": res["roofline_tok_s"]})
    for key, value in res.items():
        for old, new in ((r"^decode_bs1_tp(\d+)_", rf"decode_bs1_tp\1_{tag}_"), (r"^offline_tp(\d+)_", rf"offline_tp\1_{tag}_"),
                         (r"^tp(\d+)_", rf"tp\1_{tag}_")):
            if re.match(old, key):
                out[re.sub(old, new, key)] = value
    for tp in (1, 2, 4, 8):
        for kind in ("decode_bs1_tp{}{}_tok_s", "offline_tp{}{}_output_tok_s"):
            bf16, quantized = kind.format(tp, ""), kind.format(tp, f"_{tag}")
            if out.get(bf16) and out.get(quantized):
                out[quantized.replace("_tok_s", "_vs_bf16")] = out[quantized] / out[bf16]
    return out


def print_table(r: dict) -> None:
    def fmt(key, unit="tok/s", gbps_key=None, samples_key=None, digits=1):
        v = r.get(key)
        if v is None:
            return "n/a"
        s = f"{v:,.{digits}f} {unit}"
        if gbps_key and r.get(gbps_key):
            s += f"  ({r[gbps_key]:,.0f} GB/s of weights)"
        if samples_key and r.get(samples_key):
            runs = r[samples_key]
            s += f"  [median of {len(runs)}: {min(runs):,.1f} to {max(runs):,.1f}]"
        return s

    sizes = sorted(int(k[len("tp"):-len("_startup_s")]) for k in r if k.startswith("tp") and k.endswith("_startup_s"))
    base = sizes[0] if sizes else 1
    offline = f"offline {OFFLINE_REQUESTS}x({OFFLINE_PROMPT}+{OFFLINE_OUTPUT})"
    rows = [
        ("device", f"{r['device']} ({r['device_kind']}), torch {r['torch']}, commit {r['commit']}"),
        ("model shape", r.get("model_shape", "llama3-8b")),
        ("copy bandwidth (read + write)", f"{r['copy_GBps']:,.0f} GB/s"),
        ("roofline, batch 1 (weights once per token)", f"{r['roofline_tok_s']:,.1f} tok/s on one GPU"),
    ]
    for tp in sizes:
        rows.append((f"decode batch 1, TP={tp}", fmt(f"decode_bs1_tp{tp}_tok_s", gbps_key=f"decode_bs1_tp{tp}_GBps",
                                                     samples_key=f"decode_bs1_tp{tp}_samples")))
        fraction = r.get(f"decode_bs1_tp{tp}_fraction_of_roofline")
        rows.append((f"  of the TP={tp} roofline ({tp} x one GPU's)", "n/a" if fraction is None else f"{fraction:.1%}"))
        if f"decode_bs1_tp{tp}_graph_replay_ms" in r:
            rows.append(("  graph replay alone", fmt(f"decode_bs1_tp{tp}_graph_replay_ms", "ms", digits=3)))
        if tp != base:
            rows.append((f"  TP={tp} / TP={base} at batch 1", fmt(f"decode_bs1_tp{tp}_speedup", "x", digits=2)))
            rows.append((f"  TP={base} vs TP={tp} bf16, first 16 tokens agree",
                         fmt(f"tp{base}_tp{tp}_bf16_first16_agree_fraction", "of prompts", digits=2)))
        rows.append((f"{offline}, TP={tp}", fmt(f"offline_tp{tp}_output_tok_s", samples_key=f"offline_tp{tp}_samples")))
        rows.append((f"  all-reduce choice at TP={tp}", r.get(f"tp{tp}_allreduce_choice", "none (one GPU)")))
        for key in (k for k in r if k.startswith(f"tp{tp}_prefill_") and k.endswith("_tokens_s")):
            tokens = key[len(f"tp{tp}_prefill_"):-len("_tokens_s")]
            rows.append((f"  prefill of one {tokens}-token prompt, TP={tp}", fmt(key, "s", digits=2)))
    rows += [
        ("HF transformers decode batch 1", fmt("hf_decode_bs1_tok_s")),
        (f"HF generate, batch {HF_BATCH}", fmt("hf_offline_output_tok_s")),
        ("offline TP=1 / HF", fmt("offline_tp1_vs_hf", "x")),
    ]
    rows += online_rows(r, fmt)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def online_rows(r: dict, fmt) -> list[tuple[str, str]]:
    """The online phase's rows of the table: none when it did not run."""
    if "online_error" in r:
        return [("online (shardserve serve + bench)", f"failed: {r['online_error']}")]
    workload = r.get("online_workload")
    if not workload:
        return []
    tp = workload.get("tensor_parallel_size", 1)
    served = f"online TP={tp} {workload['requests']}x({workload['prompt_tokens']}+{workload['output_tokens']})"
    servers = "" if workload.get("api_server_count") is None else f", {workload['api_server_count']} API servers"
    rows = [(f"online TPOT p50 at concurrency 1 ({workload['c1_requests']} requests{servers})",
             fmt("online_c1_tpot_ms", "ms", digits=2))]
    levels = workload["levels"][1:]
    for c in levels:
        tpot = r.get(f"online_c{c}_tpot_ms")
        rows.append((f"{served}, concurrency {c}",
                     fmt(f"online_c{c}_output_tok_s") + ("" if tpot is None else f"  (TPOT p50 {tpot:,.1f} ms)")))
        if f"online_c{c}_vs_offline" in r:
            rows.append((f"  concurrency {c} / offline TP={tp}", fmt(f"online_c{c}_vs_offline", "x", digits=2)))
    if levels and f"online_c{max(levels)}_server_cpu_s" in r:
        rows.append((f"  server CPU during concurrency {max(levels)}",
                     fmt(f"online_c{max(levels)}_server_cpu_s", "s") +
                     f" in {r.get(f'online_c{max(levels)}_duration_s', 0):,.1f} s"))
        by_process = r.get(f"online_c{max(levels)}_cpu_s_by_process") or {}
        client = r.get(f"online_c{max(levels)}_client_cpu_s")
        parts = [f"{name} {seconds:,.1f} s" for name, seconds in sorted(by_process.items())]
        parts += [] if client is None else [f"bench client {client:,.1f} s"]
        if parts:
            rows.append(("  CPU by process", ", ".join(parts)))
    return rows


if __name__ == "__main__":
    sys.exit(main())
