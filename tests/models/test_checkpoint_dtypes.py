"""16-bit and GGUF-quantized checkpoints under --dtype auto on CPUs: greedy tokens equal Hugging Face
transformers' float32 greedy generate on the same weights, at TP 1, 2 and 3, with odd shapes, for every CPU
linear kernel; and a request gives the same tokens alone as inside a batch."""

from __future__ import annotations

import pytest
import torch

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts, transformers_greedy

NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 17, 40, 1, 9, 23)


def _prompts(vocab: int = 1000) -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=99, vocab=vocab)


def _reference(model_dir: str, gguf_file: str | None = None, new_tokens: int = NEW_TOKENS, vocab: int = 1000,
               count: int = len(PROMPT_LENGTHS)) -> tuple[tuple[int, ...], ...]:
    """transformers in float32 on the checkpoint's values (16-bit weights widen exactly; GGUF is dequantized), for
    the first `count` prompts."""
    return transformers_greedy(model_dir, tuple(map(tuple, _prompts(vocab)[:count])), new_tokens, gguf_file=gguf_file)


def _alone_and_batched(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[list, list]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    batched = [tuple(o.token_ids) for o in llm.generate(prompts, params)]
    alone = [tuple(llm.generate([p], params)[0].token_ids) for p in prompts]
    return alone, batched


def _check(model: str, tp: int, expected, prompts, new_tokens: int, what: str) -> str:
    with LLM(model, tensor_parallel_size=tp, kv_cache_memory_gb=0.1, max_model_len=256) as llm:
        plan = llm.engine.runner.plan
        alone, batched = _alone_and_batched(llm, prompts, new_tokens)
        free, total = llm.engine.block_manager.num_free_blocks, llm.engine.block_manager.num_blocks
    assert plan.dtype == torch.float32, f"{what}: --dtype auto on a CPU must compute in float32"
    for i, (a, b, ref) in enumerate(zip(alone, batched, expected)):
        assert b == ref, f"{what} TP={tp} ({plan.describe()}): prompt {i} in a batch differs from transformers"
        assert a == b, f"{what} TP={tp} ({plan.describe()}): prompt {i} alone differs from the same in a batch"
    assert free == total, "every KV block must be back in the free pool"
    return plan.linear


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_checkpoints_match_transformers_alone_and_batched(tiny_model_dir, set_env, dtype, tp):
    set_env(SHARDSERVE_LINEAR_KERNEL=None)
    model = tiny_model_dir(f"llama-odd-{dtype}")
    linear = _check(model, tp, _reference(model), _prompts(), NEW_TOKENS, f"{dtype} checkpoint")
    # A float16 checkpoint's values are not bfloat16 values: its weights must not take the bfloat16 kernel.
    assert linear != "bf16-decode" or dtype == "bfloat16"


@pytest.mark.parametrize("kernel", ["torch", "onednn-packed", "bf16-decode", "blockq-decode"])
def test_every_cpu_linear_kernel_forced_in_turn(tiny_model_dir, set_env, kernel):
    """Each kernel the plan can pick on some CPU, forced here whatever this CPU is, at TP=2 (ragged 75-wide
    MLP shards, replicated attention). (blockq-decode finds no GGUF blocks in these weights, so it runs its
    float32 form; its blocks are served in the GGUF test below.)"""
    from shardserve.layers.linear_kernels import build_linear_kernel

    if build_linear_kernel(kernel)[0] is None:
        pytest.skip(build_linear_kernel(kernel)[1])
    set_env(SHARDSERVE_LINEAR_KERNEL=kernel)
    model = tiny_model_dir("llama-odd-bfloat16")
    assert _check(model, 2, _reference(model), _prompts(), NEW_TOKENS, f"forced {kernel}") == kernel


@pytest.mark.parametrize("tp", [1, 3])
def test_a_quantized_gguf_matches_transformers_on_its_dequantized_weights(smollm2_gguf, set_env, tp):
    """SmolLM2's Q4_1 file: at TP=3 each rank holds 3 query heads and 1 KV head. (TP=2 is served over HTTP in
    tests/entrypoints/test_real_engine_serving.py.)"""
    pytest.importorskip("accelerate")
    from pathlib import Path

    set_env(SHARDSERVE_LINEAR_KERNEL=None)
    path = Path(smollm2_gguf)
    prompts = _prompts(49152)[:3]
    expected = _reference(str(path.parent), path.name, 12, 49152, count=3)
    linear = _check(smollm2_gguf, tp, expected, prompts, 12, "Q4_1 GGUF")
    from shardserve.layers.linear_kernels import build_linear_kernel

    if build_linear_kernel("blockq-decode")[0] is not None:
        assert linear == "blockq-decode", "decode steps should read the file's own 4- and 8-bit blocks"
