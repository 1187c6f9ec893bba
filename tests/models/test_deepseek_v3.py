"""DeepSeek-V3 and V2 through the real engine: greedy tokens equal transformers' float32 generate for four prompts at
once, the longer ones prefilled in chunks (the expanded form) beside other sequences' decode steps (the absorbed
form), at TP 1, 2 and 3 (real gloo ranks) and with expert parallelism at 2; with and without q_lora_rank, groups of
experts, an expert count that two ranks do not divide, and V2's softmax routing under YaRN. The latent cache holds
one entry of kv_lora_rank + qk_rope_head_dim a token a layer; preemption, prefix-cache hits, the same prompt twice
at once, 16 prompts at once and a sleep/wake cycle give the tokens each prompt gives alone."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.helpers.configs import config_with
from tests.helpers.reference import random_prompts, transformers_greedy
from tests.helpers.state_models import assert_all_returned, cpu_llm, greedy, greedy_choices_over_http

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 17, 40, 1)


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def _reference(model_dir: str, prompts=None, new_tokens: int = NEW_TOKENS) -> tuple[tuple[int, ...], ...]:
    prompts = _prompts() if prompts is None else prompts
    return transformers_greedy(model_dir, tuple(map(tuple, prompts)), new_tokens)


def _moe_blocks(llm) -> list:
    return [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "DeepseekMoE"]


@pytest.mark.parametrize("name, tp, expert_parallel", [
    ("deepseek-v3", 1, False), ("deepseek-v3", 2, False), ("deepseek-v3", 3, False), ("deepseek-v3", 2, True),
    ("deepseek-v3-noq", 1, False), ("deepseek-v3-noq", 3, False), ("deepseek-v3-noq", 2, True),
    ("deepseek-v3-odd", 2, True), ("deepseek-v2", 1, False), ("deepseek-v2", 2, False)])
def test_prompts_together_in_chunks_equal_transformers(tiny_model_dir, name, tp, expert_parallel):
    """All four prompts in one batch, the 17- and 40-token ones prefilled in chunks of at most 12 tokens. Heads split
    where they divide among the ranks (4 in 2, 6 in 2 and 3), whole on every rank where not (4 in 3, 3 in 2); under
    expert parallelism rank 0 holds the first experts whole, or where they do not divide (5 in 2) every expert's
    first features; at TP 3 the experts' 32 features do not split, and every rank holds every expert whole."""
    model_dir = tiny_model_dir(name)
    expected = _reference(model_dir)
    with cpu_llm(model_dir, tensor_parallel_size=tp, max_num_batched_tokens=12,
                 enable_expert_parallel=expert_parallel) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
        moe = _moe_blocks(llm)[0]
        attn = llm.engine.runner.model.model.layers[0].self_attn
    for prompt, out, ref in zip(_prompts(), outputs, expected):
        assert tuple(out.token_ids) == ref, f"{name} TP={tp} EP={expert_parallel}, prompt of {len(prompt)} tokens"
    heads = attn.dims.num_heads
    assert attn.num_heads == (heads // tp if heads % tp == 0 else heads)
    experts = moe.num_experts
    if expert_parallel and experts % tp == 0:
        assert moe.experts_held == (0, experts // tp) and moe.rows == (0, 32)
    else:  # 32 features split in 2, not in 3 (whole on every rank)
        assert moe.experts_held == (0, experts) and moe.rows == ((0, 32 // tp) if 32 % tp == 0 else (0, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-noq", "deepseek-v2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_on_gpus_in_chunks_equals_transformers(tiny_model_dir, name, tp):
    """The CUDA path at float32: decode steps in CUDA graphs on the Triton kernels (one launch storing the entries
    and rotating the queries, interleaved or not, under YaRN for V2; the latent decode), prompts prefilled in chunks
    beside others' decode steps; at TP 2 each GPU holds its heads' share (the latent cache whole on each)."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    from shardserve.entrypoints.llm import LLM

    model_dir = tiny_model_dir(name)
    expected = _reference(model_dir)
    with LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory_gb=0.01, max_num_seqs=4,
             max_num_batched_tokens=12, tensor_parallel_size=tp) as llm:
        assert "attention mla-triton" in llm.engine.runner.plan.describe()
        assert llm.engine.runner.graphs is not None
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    assert tuple(tuple(o.token_ids) for o in outputs) == expected, f"{name} TP={tp}"


@pytest.mark.parametrize("tp", [1, 2])
def test_two_pipeline_stages_give_transformers_tokens(tiny_model_dir, tp):
    """-pp 2 (at TP 1 and 2): each stage holds its layers' latent cache and runs their latent attention; the four
    prompts, chunked beside each other's decode steps, give transformers' tokens."""
    model_dir = tiny_model_dir("deepseek-v3")
    with cpu_llm(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=2, max_num_batched_tokens=12) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
        assert len(llm.engine.runner.kv_caches) == 2  # layers 0-1 of 3 on stage 0 (rank 0's): its own caches
    assert tuple(tuple(o.token_ids) for o in outputs) == _reference(model_dir)


def test_the_latent_cache_holds_one_entry_a_token(tiny_model_dir):
    """One plane of kv_lora_rank + qk_rope_head_dim (32 + 8) features a token a layer, whatever the heads."""
    with cpu_llm(tiny_model_dir("deepseek-v3")) as llm:
        runner = llm.engine.runner
        assert runner._kv_bytes_per_block() == 3 * runner.block_size * (32 + 8) * 4
        assert [tuple(t.shape) for t in runner.kv_caches[0]] == [(runner.num_blocks * runner.block_size, 1, 40)]


def test_sixteen_prompts_at_once_equal_each_alone(tiny_model_dir):
    prompts = random_prompts([3 + 5 * i for i in range(16)], seed=7)
    with cpu_llm(tiny_model_dir("deepseek-v3"), max_num_seqs=16, max_num_batched_tokens=64) as llm:
        together = [tuple(o.token_ids) for o in llm.generate(prompts, greedy(NEW_TOKENS))]
        alone = [tuple(llm.generate([p], greedy(NEW_TOKENS))[0].token_ids) for p in prompts]
        assert_all_returned(llm)
    assert together == alone


def test_prefix_cache_hits_and_the_same_prompt_twice_give_transformers_tokens(tiny_model_dir):
    """The 40-token prompt, then the same prompt twice at once (as n=2 choices of one prompt are): the copies read
    the first one's cached latent blocks (prefix hits) and give the same tokens."""
    model_dir = tiny_model_dir("deepseek-v3")
    prompt = _prompts()[2]
    with cpu_llm(model_dir, enable_prefix_caching=True) as llm:
        first = llm.generate([prompt], greedy(NEW_TOKENS))[0].token_ids
        again = [o.token_ids for o in llm.generate([prompt, prompt], greedy(NEW_TOKENS))]
        hits = llm.engine.stats().prefix_hits
        assert_all_returned(llm)
    assert hits > 0
    assert [first] + again == [list(_reference(model_dir)[2])] * 3


def test_preempted_sequences_recompute_to_transformers_tokens(tiny_model_dir):
    """A latent cache of 6 blocks of 16 tokens for four sequences that grow to 52 tokens: later arrivals are preempted and
    recomputed, and every sequence still gives transformers' tokens."""
    model_dir = tiny_model_dir("deepseek-v3")
    prompts = [p for p in _prompts() if len(p) == 40] + [list(range(100 + i, 140 + i)) for i in range(3)]
    with cpu_llm(model_dir, kv_cache_memory_gb=0.00005, max_model_len=64) as llm:
        assert llm.engine.block_manager.num_blocks < 16
        outputs = llm.generate(prompts, greedy(12))
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_returned(llm)
    assert [tuple(o.token_ids) for o in outputs] == list(_reference(model_dir, prompts, 12))


@pytest.mark.parametrize("level", [1, 2])
def test_after_sleep_and_wake_the_tokens_are_transformers(tiny_model_dir, level):
    model_dir = tiny_model_dir("deepseek-v3")
    with cpu_llm(model_dir) as llm:
        llm.generate([_prompts()[0]], greedy(NEW_TOKENS))
        llm.sleep(level)
        llm.wake_up()
        got = llm.generate([_prompts()[1]], greedy(NEW_TOKENS))[0].token_ids
        assert_all_returned(llm)
    assert tuple(got) == _reference(model_dir)[1]


def test_a_multi_token_prediction_layer_is_skipped(tiny_model_dir, caplog):
    """Released V3 checkpoints carry `model.layers.{num_hidden_layers}` (multi-token prediction, not served): left
    unread with one log line; a missing tensor of the model is still refused."""
    from safetensors.torch import load_file

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models.deepseek_v3 import DeepseekV3ForCausalLM
    from shardserve.weights.loader import load_tensors

    model_dir = tiny_model_dir("deepseek-v3")
    cfg = ModelConfig.from_model_path(model_dir)
    model = DeepseekV3ForCausalLM(cfg, Communicator(None, 0, 1), torch.float32, max_positions=64)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    extra = {"model.layers.3.enorm.weight": torch.zeros(64), "model.layers.3.eh_proj.weight": torch.zeros(64, 128)}
    with caplog.at_level(logging.INFO, logger="shardserve.weights.loader"):
        load_tensors(model, [*tensors.items(), *extra.items()], False, "a checkpoint with an mtp layer")
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "left 2 tensors" in lines[0]
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_tensors(model, [(n, t) for n, t in tensors.items() if n != "model.norm.weight"], False, "short")


def test_the_config_names_the_latent_attention_and_the_routing(tiny_model_dir):
    from shardserve.config import ModelConfig

    v3 = ModelConfig.from_model_path(tiny_model_dir("deepseek-v3"))
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim) == (24, 32, 16, 8,
                                                                                                          12)
    assert v3.head_dim == 8 and v3.rope_interleave and v3.moe_layers == (1, 2)
    assert (v3.scoring_func, v3.num_expert_groups, v3.topk_expert_groups, v3.routed_scaling_factor) == ("sigmoid", 4,
                                                                                                       2, 2.5)
    assert v3.shared_expert_intermediate_size == 32
    noq = ModelConfig.from_model_path(tiny_model_dir("deepseek-v3-noq"))
    assert noq.q_lora_rank == 0 and not noq.rope_interleave and noq.shared_expert_intermediate_size == 64
    v2 = ModelConfig.from_model_path(tiny_model_dir("deepseek-v2"))
    assert (v2.scoring_func, v2.num_expert_groups, v2.renormalize_topk, v2.rope_interleave) == ("softmax", 4, False,
                                                                                               True)


def test_v2_greedy_routing_ignores_the_groups(tiny_model_dir, tmp_path):
    from shardserve.config import ModelConfig

    cfg = ModelConfig.from_model_path(config_with(tiny_model_dir("deepseek-v2"), tmp_path, topk_method="greedy"))
    assert (cfg.num_expert_groups, cfg.topk_expert_groups) == (1, 1)
    with pytest.raises(ValueError, match="topk_method='sparse'"):
        ModelConfig.from_model_path(config_with(tiny_model_dir("deepseek-v2"), tmp_path, topk_method="sparse"))


def test_an_fp8_latent_cache_holds_four_times_the_tokens_and_reads_what_it_stored(tiny_model_dir, monkeypatch):
    """--kv-cache-dtype fp8: each latent-cache entry stored in e4m3 (scale 1.0), so the same memory holds four times
    a float32 cache's tokens; greedy tokens equal transformers' float32 ones whose attention reads the normed latents
    and rotated rope keys rounded to e4m3, as the cache holds them (its cache keeps the compressed entries too)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from shardserve.attention import kv_quant
    from tests.helpers.reference import transformers_model

    model_dir = tiny_model_dir("deepseek-v3")
    expand = hf.DeepseekV3Attention.expand_kv

    def rounded(self, kv_nope, k_rot):
        return expand(self, kv_quant.round_like_cache(kv_nope, 1.0, kv_quant.FP8),
                      kv_quant.round_like_cache(k_rot, 1.0, kv_quant.FP8))

    monkeypatch.setattr(hf.DeepseekV3Attention, "expand_kv", rounded)
    model = transformers_model(model_dir, None, False)
    with torch.inference_mode():
        expected = [tuple(model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):]
                          .tolist()) for p in _prompts()]
    with cpu_llm(model_dir, kv_cache_dtype="fp8", max_num_batched_tokens=12) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
        fp8_blocks = llm.engine.block_manager.num_blocks
    assert [tuple(o.token_ids) for o in outputs] == expected
    with cpu_llm(model_dir) as llm:
        assert fp8_blocks == 4 * llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_absorbed_decode_agrees_with_the_expanded_form(dtype):
    """The start-up check's comparison on V3's real sizes (16 heads a rank: 128 at TP 8): within the dtype's
    tolerance, and far outside it with the wrong softmax scale."""
    from shardserve.attention.mla import mla_decode
    from shardserve.kernels.self_check import TOLERANCE
    from shardserve.layers.mla import MlaDims, check_reference

    dims = MlaDims(7168, 128, 1536, 512, 128, 64, 128, 1e-6, 192 ** -0.5, True)
    assert check_reference(dims, 16, 37, dtype, torch.device("cpu"), 16) < TOLERANCE[dtype]

    def wrong_scale(q, cache, tables, lens, block_size, scale, latent):
        return mla_decode(q, cache, tables, lens, block_size, 2 * scale, latent)

    assert check_reference(dims, 16, 37, dtype, torch.device("cpu"), 16, wrong_scale) > 10 * TOLERANCE[dtype]


def test_start_up_stops_on_a_wrong_decode(tiny_model_dir, monkeypatch):
    from shardserve.attention import mla
    from shardserve.kernels.plan import KernelPlanError

    original = mla.mla_decode

    def dropped_rope(q, cache, tables, lens, block_size, scale, latent):
        return original(torch.cat((q[..., :latent], 0 * q[..., latent:]), -1), cache, tables, lens, block_size,
                              scale, latent)

    monkeypatch.setattr(mla, "mla_decode", dropped_rope)
    with pytest.raises(KernelPlanError, match="absorbed decode is off the expanded form"):
        cpu_llm(tiny_model_dir("deepseek-v3"))


@pytest.mark.parametrize("layers", ["packed", "dequantized"])
def test_an_fp8_block_checkpoint_gives_transformers_tokens_on_its_values(quantized_model_dir, set_env, layers):
    """DeepSeek-V3's FP8 layout (e4m3 with block scales) on every projection: the linear layers kept packed
    (SHARDSERVE_QUANTIZED_LAYERS=packed) or read as their values, kv_b_proj read as the values it encodes in both
    (the absorbed decode reads it as W_UK and W_UV); the tokens are transformers' on those values."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS=layers)
    quant_dir, float_dir = quantized_model_dir("deepseek-v3", "fp8-block")
    with cpu_llm(quant_dir, max_num_batched_tokens=12) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(_prompts(), greedy(NEW_TOKENS))]
        attn = llm.engine.runner.model.model.layers[1].self_attn
        assert attn.kv_b_proj.packed is None and attn.kv_b_proj.weight.dtype == torch.float32
        # q_a_proj's 64 input columns are whole groups of 32 (o_proj's 48 are not: read as values)
        assert (attn.q_a_proj.packed is not None) == (layers == "packed")
    assert outputs == list(_reference(float_dir))


def test_a_device_decode_that_fails_its_check_gives_way_to_torch(tiny_model_dir, monkeypatch, caplog):
    """Where a decode kernel of mla_decode's signature is chosen (the Triton one on CUDA) and disagrees with the
    expanded form, start-up warns and decodes with torch's, and the tokens stay transformers'."""
    from shardserve.attention import mla

    def wrong_scale(q, cache, tables, lens, block_size, scale, latent):
        return mla.mla_decode(q, cache, tables, lens, block_size, 2 * scale, latent)

    monkeypatch.setattr(mla, "device_decode", lambda device: ("mla-triton", wrong_scale))
    model_dir = tiny_model_dir("deepseek-v3")
    with caplog.at_level(logging.WARNING, logger="shardserve.engine.kernel_setup"):
        with cpu_llm(model_dir) as llm:
            assert llm.engine.runner.attention.name == "mla-torch"
            got = llm.generate([_prompts()[1]], greedy(NEW_TOKENS))[0].token_ids
    assert any("mla-triton failed its start-up check" in r.getMessage() for r in caplog.records)
    assert tuple(got) == _reference(model_dir)[1]


def test_n_choices_over_http_each_equal_transformers(tiny_model_dir):
    """`n: 2` over HTTP: both greedy choices are transformers' tokens, read from one prompt's latent entries, and
    every block is back in the pool afterwards."""
    from shardserve.tokenizer import Tokenizer

    model_dir = tiny_model_dir("deepseek-v3")
    prompt = _prompts()[2]
    body = greedy_choices_over_http(model_dir, prompt, 2, NEW_TOKENS)
    expected = Tokenizer.from_model_path(model_dir).decode(list(_reference(model_dir)[2]))
    assert [c["text"] for c in body["choices"]] == [expected, expected]
    assert body["usage"]["prompt_tokens"] == len(prompt)
