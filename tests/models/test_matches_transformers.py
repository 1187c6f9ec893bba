"""Greedy tokens from shardserve equal Hugging Face transformers' greedy generate on the same weights,
at every tensor-parallel size, including sizes where heads or features don't split evenly."""

from __future__ import annotations


import pytest
import torch

from shardserve.engine.sampling_params import SamplingParams
from shardserve.entrypoints.llm import LLM
from tests.models.reference import random_prompts, transformers_greedy
from tests.tiny_models import TINY_SPECS

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 17, 40, 1)


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def _reference(model_dir: str) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy tokens for each prompt alone."""
    return transformers_greedy(model_dir, tuple(map(tuple, _prompts())), NEW_TOKENS)


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_greedy_tokens_match_transformers(tiny_model_dir, name, tp):
    _check_matches(tiny_model_dir(name), name, tp, device="cpu")


@pytest.mark.parametrize("tp", [4, 8])
def test_greedy_tokens_match_transformers_at_four_and_eight_ranks(tiny_model_dir, tp):
    """The sizes of 4- and 8-GPU machines: at 8 ranks each rank holds one of the 8 query heads, and the 2 KV
    heads are replicated 2 or 4 times."""
    _check_matches(tiny_model_dir("llama-untied"), "llama-untied", tp, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_greedy_tokens_match_transformers_on_gpus(tiny_model_dir, name, tp):
    """The CUDA path: NCCL data plane between GPUs, float32, against the CPU reference."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s), found {torch.cuda.device_count()}")
    _check_matches(tiny_model_dir(name), name, tp, device="cuda")


def _check_matches(model_dir: str, name: str, tp: int, device: str,
                   expected: tuple[tuple[int, ...], ...] | None = None) -> None:
    """shardserve's greedy tokens for model_dir against `expected` (default: transformers on model_dir itself;
    pass transformers' tokens on another checkpoint of the same values, e.g. the float one a quantized or
    GGUF file was written from)."""
    expected = _reference(model_dir) if expected is None else expected
    assert all(len(e) == NEW_TOKENS for e in expected)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=tp, device=device, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = llm.generate(_prompts(), params)
        free, total = llm.engine.block_manager.num_free_blocks, llm.engine.block_manager.num_blocks
    for prompt, out, ref in zip(_prompts(), outputs, expected):
        assert tuple(out.token_ids) == ref, f"{name} TP={tp} on {device}, prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
    assert free == total, "every KV block must be back in the free pool"
