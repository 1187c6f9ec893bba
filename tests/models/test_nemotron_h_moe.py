"""Nemotron-3's mixture-of-experts layers through the real engine: greedy tokens equal transformers' float32 generate
for four prompts at once, the longer ones prefilled in chunks, at TP 1, 2 and 3 (experts split by features, real
process groups) and with expert parallelism at TP 2, with and without LatentMoE; a preempted sequence recomputes
to the same tokens; dummy weights build the same model at every TP; the SSM states kept in bfloat16
(--mamba-ssm-cache-dtype) serve close to float32. Configs the engine does not serve are refused by name."""

from __future__ import annotations


import pytest
import torch

from shardserve.entrypoints.llm import LLM
from tests.helpers.configs import config_with
from tests.helpers.reference import random_prompts, transformers_greedy
from tests.helpers.state_models import assert_all_returned, cpu_llm, greedy

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 17, 40, 1)
NAMES = ("nemotron-h-moe", "nemotron-h-latent")


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def _reference(model_dir: str, prompts=None, new_tokens: int = NEW_TOKENS) -> tuple[tuple[int, ...], ...]:
    prompts = _prompts() if prompts is None else prompts
    return transformers_greedy(model_dir, tuple(map(tuple, prompts)), new_tokens)


def _expert_blocks(llm: LLM) -> list:
    return [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "NemotronHMoE"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp, expert_parallel", [(1, False), (2, False), (3, False), (2, True)])
def test_prompts_together_in_chunks_equal_transformers(tiny_model_dir, name, tp, expert_parallel):
    """All four prompts in one batch, the 17- and 40-token ones prefilled in chunks of at most 12 tokens beside the
    others' steps. Rank 0's experts: features [0, 48 / tp) of every expert, or under expert parallelism the first
    half of the experts whole."""
    model_dir = tiny_model_dir(name)
    expected = _reference(model_dir)
    with cpu_llm(model_dir, tensor_parallel_size=tp, max_num_batched_tokens=12,
              enable_expert_parallel=expert_parallel) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
        shard = _expert_blocks(llm)[0].experts.shard
    for prompt, out, ref in zip(_prompts(), outputs, expected):
        assert tuple(out.token_ids) == ref, f"{name} TP={tp} EP={expert_parallel}, prompt of {len(prompt)} tokens"
    experts = {"nemotron-h-moe": 8, "nemotron-h-latent": 6}[name]
    if expert_parallel:
        assert shard.experts == (0, experts // 2) and shard.rows == (0, 48)
    else:
        assert shard.experts == (0, experts) and shard.rows == (0, 48 // tp) and shard.sharded == (tp > 1)


def test_preempted_sequences_recompute_to_transformers_tokens(tiny_model_dir):
    """A KV cache too small for four sequences that grow to 52 tokens: later arrivals are preempted and recomputed
    from an empty Mamba-2 state, and every sequence still gives transformers' tokens."""
    model_dir = tiny_model_dir("nemotron-h-moe")
    prompts = [p for p in _prompts() if len(p) == 40] + [list(range(100 + i, 140 + i)) for i in range(3)]
    with cpu_llm(model_dir, kv_cache_memory_gb=0.00006, max_model_len=64) as llm:
        assert llm.engine.block_manager.num_blocks < 16
        outputs = llm.generate(prompts, greedy(12))
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_returned(llm)
    assert [tuple(o.token_ids) for o in outputs] == list(_reference(model_dir, prompts, 12))


def test_dummy_weights_build_the_same_model_at_every_tp(tiny_model_dir):
    """--load-format dummy (the experts stacked, one tensor each): the same tokens at TP 1 and at TP 2 with expert
    parallelism."""
    prompts = [[5, 6, 7], [40] * 9]
    outputs = {}
    for tp in (1, 2):
        with cpu_llm(tiny_model_dir("nemotron-h-latent"), tensor_parallel_size=tp, load_format="dummy",
                  enable_expert_parallel=tp > 1) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))]
    assert outputs[1] == outputs[2]


def test_bfloat16_ssm_states_serve_close_to_float32(tiny_model_dir):
    """--mamba-ssm-cache-dtype bfloat16: the Mamba-2 state pools hold bfloat16 SSM states (the convolution inputs
    stay in the model's dtype), and greedy decoding from them starts as transformers' float32 one does."""
    model_dir = tiny_model_dir("nemotron-h-moe")
    with cpu_llm(model_dir, mamba_ssm_cache_dtype="bfloat16") as llm:
        pools = llm.engine.runner.state_pools
        assert pools and all(p.ssm.dtype == torch.bfloat16 and p.conv.dtype == torch.float32 for p in pools.values())
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
    agreeing = [next((i for i, (a, b) in enumerate(zip(o.token_ids, ref)) if a != b), NEW_TOKENS)
                for o, ref in zip(outputs, _reference(model_dir))]
    assert min(agreeing) >= 2 and sum(agreeing) >= 3 * NEW_TOKENS, f"tokens agreeing with float32: {agreeing}"


def test_the_ssm_state_dtype_is_refused_for_a_model_without_mamba_layers(tiny_model_dir):
    with pytest.raises(ValueError, match="--mamba-ssm-cache-dtype bfloat16: Qwen3ForCausalLM has no Mamba-2"):
        cpu_llm(tiny_model_dir("qwen3"), mamba_ssm_cache_dtype="bfloat16")


def test_the_config_names_the_experts_and_their_routing(tiny_model_dir):
    from shardserve.config import ModelConfig

    cfg = ModelConfig.from_model_path(tiny_model_dir("nemotron-h-latent"))
    assert cfg.layer_types == ("moe", "linear_attention", "full_attention", "mlp", "moe") and cfg.moe_layers == (0, 4)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_latent_size) == (6, 3, 48, 32)
    assert (cfg.num_expert_groups, cfg.topk_expert_groups, cfg.renormalize_topk) == (3, 2, False)
    assert cfg.shared_expert_intermediate_size == 40 and cfg.routed_scaling_factor == 1.5


@pytest.mark.parametrize("changes, refusal", [
    (dict(n_shared_experts=2), "n_shared_experts=2"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(n_group=3), "do not split into n_group=3"),
])
def test_what_is_not_served_is_refused_by_name(tiny_model_dir, tmp_path, changes, refusal):
    from shardserve.config import ModelConfig

    with pytest.raises(ValueError, match=refusal):
        ModelConfig.from_model_path(config_with(tiny_model_dir("nemotron-h-moe"), tmp_path, **changes))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ("nemotron-h", "nemotron-h-moe", "nemotron-h-latent"))
@pytest.mark.parametrize("tp", [1, 2])
def test_on_gpus_in_chunks_equals_transformers(tiny_model_dir, name, tp):
    """The CUDA path at float32: the Mamba-2 state pools on the device, the Triton decode kernels stepping them in
    their slots, the non-gated experts on the fused kernel, decode replayed from CUDA graphs, prompts prefilled in
    chunks beside others' decode steps."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    model_dir = tiny_model_dir(name)
    expected = _reference(model_dir)
    with LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory_gb=0.01, max_num_seqs=4,
             max_num_batched_tokens=12, tensor_parallel_size=tp) as llm:
        assert "Mamba-2 triton fused decode" in llm.engine.runner.plan.describe()
        assert llm.engine.runner.graphs is not None  # the experts on the fused kernel: decode in CUDA graphs
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    assert tuple(tuple(o.token_ids) for o in outputs) == expected, f"{name} TP={tp}"


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8-block"])
def test_a_quantized_checkpoint_at_two_ranks_gives_transformers_tokens_on_its_values(quantized_model_dir, scheme):
    """Every projection of the tiny model (Mamba-2 in_proj / out_proj, attention, each expert's up and down, the
    shared expert) quantized to NVFP4 as ModelOpt writes it (e2m1 codes, an e4m3 scale a 16 weights, a float32
    global scale), or to FP8 in 128 x 128 blocks: served at TP 2 (the experts' 48 features split 24 a rank, across a group of 16), it gives
    transformers' tokens on the values the checkpoint encodes. (The LatentMoE model's 40-feature shared expert is
    no multiple of 16: NVFP4 cannot encode it.)"""
    name = "nemotron-h-moe"
    quant_dir, float_dir = quantized_model_dir(name, scheme)
    expected = _reference(str(float_dir))
    with cpu_llm(str(quant_dir), tensor_parallel_size=2) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    assert tuple(tuple(o.token_ids) for o in outputs) == expected, name


@pytest.mark.parametrize("layers", ["dequantized", "packed"])
def test_nvfp4_as_nvidia_ships_it_with_attention_and_the_mamba_layer_before_it_left_16_bit(tiny_model_dir, tmp_path,
                                                                                         set_env, layers):
    """NVIDIA's NVFP4 Nemotron-3 checkpoints leave the attention layers and the Mamba-2 layers that feed them in
    bf16 (ModelOpt's exclude_modules names them), the rest NVFP4: such a checkpoint loads each layer as the checkpoint
    holds it, dequantized or kept packed (SHARDSERVE_QUANTIZED_LAYERS), and at TP 2 gives transformers' tokens on the
    values it encodes."""
    from tests.helpers.quantized import write_quantized

    set_env(SHARDSERVE_QUANTIZED_LAYERS=layers)
    quant_dir, float_dir = write_quantized(tiny_model_dir("nemotron-h-moe"), "nvfp4", tmp_path,
                                           keep=("backbone.layers.0.", "backbone.layers.2."))
    expected = _reference(str(float_dir))
    with cpu_llm(str(quant_dir), tensor_parallel_size=2) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    assert tuple(tuple(o.token_ids) for o in outputs) == expected


@pytest.mark.gpu
def test_on_a_gpu_nvfp4_experts_stay_packed_on_the_fused_kernel_in_cuda_graphs(tiny_model_dir, tmp_path):
    """An NVFP4 checkpoint on CUDA (packed by default there): the non-gated experts half a byte a weight on the
    fused kernel with relu2, decode replayed from CUDA graphs, transformers' tokens on the encoded values."""
    from tests.helpers.quantized import write_quantized

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    quant_dir, float_dir = write_quantized(tiny_model_dir("nemotron-h-moe"), "nvfp4", tmp_path)
    expected = _reference(str(float_dir))
    with LLM(str(quant_dir), device="cuda", dtype="float32", kv_cache_memory_gb=0.01, max_num_seqs=4,
             max_num_batched_tokens=12) as llm:
        assert llm.engine.runner.graphs is not None
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
        experts = [block.experts for block in _expert_blocks(llm)]
        assert experts and all(e.packed is not None and e.w1.dtype == torch.uint8 for e in experts)
    assert tuple(tuple(o.token_ids) for o in outputs) == expected


@pytest.mark.parametrize("tp, expert_parallel", [(1, False), (2, True)])
def test_nvfp4_experts_kept_packed_give_transformers_tokens(quantized_model_dir, set_env, tp, expert_parallel):
    """SHARDSERVE_QUANTIZED_LAYERS=packed (the GPUs' default) on an NVFP4 checkpoint: the non-gated experts stay
    half a byte a weight with their group scales (whole experts on each rank: expert parallelism keeps the 48
    features, three groups of 16, together), each chosen expert decoded from its codes, and the tokens are
    transformers' on the values the checkpoint encodes."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = quantized_model_dir("nemotron-h-moe", "nvfp4")
    expected = _reference(str(float_dir))
    with cpu_llm(str(quant_dir), tensor_parallel_size=tp, enable_expert_parallel=expert_parallel) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
        experts = [block.experts for block in _expert_blocks(llm)]
        held = {(e.packed is not None, e.w1.dtype, e.w1.shape[-1], e.w2.dtype) for e in experts}
    assert experts and held == {(True, torch.uint8, experts[0].width // 2, torch.uint8)}
    assert tuple(tuple(o.token_ids) for o in outputs) == expected
