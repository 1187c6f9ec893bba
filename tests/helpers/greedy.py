"""shardserve's greedy tokens against transformers' on the same weights: the prompts, the reference and the check
that the dense-model, mixture-of-experts and quantized-checkpoint tests share."""

from __future__ import annotations

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts, transformers_greedy

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 17, 40, 1)


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def reference(model_dir: str) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy tokens for each prompt alone."""
    return transformers_greedy(model_dir, tuple(map(tuple, prompts())), NEW_TOKENS)


def check_matches(model_dir: str, name: str, tp: int, device: str,
                  expected: tuple[tuple[int, ...], ...] | None = None) -> None:
    """shardserve's greedy tokens for model_dir against `expected` (default: transformers on model_dir itself;
    pass transformers' tokens on another checkpoint of the same values, e.g. the float one a quantized or
    GGUF file was written from)."""
    expected = reference(model_dir) if expected is None else expected
    assert all(len(e) == NEW_TOKENS for e in expected)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=tp, device=device, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = llm.generate(prompts(), params)
        free, total = llm.engine.block_manager.num_free_blocks, llm.engine.block_manager.num_blocks
    for prompt, out, ref in zip(prompts(), outputs, expected):
        assert tuple(out.token_ids) == ref, f"{name} TP={tp} on {device}, prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
    assert free == total, "every KV block must be back in the free pool"
