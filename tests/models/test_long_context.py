"""Long contexts: YaRN-scaled RoPE past the original context equals transformers (Llama-3's scaling: the
"llama-untied" model of test_matches_transformers.py), a 16k-token prompt at TP 2 through chunked prefill equals
transformers' float32 greedy tokens, and --max-model-len is refused above the model's position limit."""

from __future__ import annotations

import time

import pytest
import torch

from shardserve.config import EngineConfig, ModelConfig
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.greedy import check_matches
from tests.helpers.reference import random_prompts, transformers_greedy

LONG_PROMPT = 16384
LONG_NEW_TOKENS = 4


def test_yarn_past_the_original_context_matches_transformers(tiny_model_dir):
    """Original context 64, factor 4: prompts of 40 tokens plus 32 new ones rotate at positions past 64, with the
    attention factor on cos and sin."""
    check_matches(tiny_model_dir("llama-yarn"), "llama-yarn", 1, "cpu")


def test_a_16k_prompt_at_tp_2_through_chunked_prefill_matches_transformers(tiny_model_dir):
    """16384 tokens in steps of 2048 (eight chunks, each attending to every earlier one) at positions up to 4 times
    the original 4096 of the YaRN model."""
    model_dir = tiny_model_dir("llama-long")
    prompt = random_prompts([LONG_PROMPT], seed=16)[0]
    started = time.perf_counter()
    expected = transformers_greedy(model_dir, (tuple(prompt),), LONG_NEW_TOKENS)[0]
    reference_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=LONG_NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=2, device="cpu", dtype="float32", kv_cache_memory_gb=0.05,
             max_model_len=LONG_PROMPT + 64, max_num_batched_tokens=2048) as llm:
        started = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        engine_s = time.perf_counter() - started
    assert len(out.prompt_token_ids) == LONG_PROMPT
    assert tuple(out.token_ids) == expected, f"(transformers {reference_s:.1f} s, shardserve {engine_s:.1f} s)"


@pytest.mark.parametrize("name, limit", [("qwen2", 512), ("llama-yarn", 256), ("llama-long", 32768)])
def test_max_model_len_above_the_position_limit_is_refused_naming_the_flag(tiny_model_dir, name, limit):
    model_config = ModelConfig.from_model_path(tiny_model_dir(name))
    assert EngineConfig(model="m", max_model_len=limit).resolve_max_model_len(model_config) == limit
    with pytest.raises(ValueError, match=f"--max-model-len {limit + 1} is above this model's limit of {limit} "
                                         f"tokens .*: lower --max-model-len to at most {limit}"):
        EngineConfig(model="m", max_model_len=limit + 1).resolve_max_model_len(model_config)


def test_dynamic_ntk_uses_transformers_base_at_the_longest_scaled_context():
    """Dynamic NTK is fixed at original x factor positions (vLLM's form); transformers computes the same
    frequencies once its sequence reaches that length."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardserve.layers.rotary import inverse_frequencies

    scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 128}
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=128,
                         rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=512)
    torch.testing.assert_close(inverse_frequencies(32, 10000.0, scaling), expected, rtol=1e-6, atol=0)
