"""Greedy tokens from shardserve equal Hugging Face transformers' greedy generate on the same weights,
at every tensor-parallel size, including sizes where heads or features don't split evenly."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.greedy import check_matches
from tests.tiny_models import TINY_SPECS


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_greedy_tokens_match_transformers(tiny_model_dir, name, tp):
    check_matches(tiny_model_dir(name), name, tp, device="cpu")


@pytest.mark.parametrize("tp", [4, 8])
def test_greedy_tokens_match_transformers_at_four_and_eight_ranks(tiny_model_dir, tp):
    """The sizes of 4- and 8-GPU machines: at 8 ranks each rank holds one of the 8 query heads, and the 2 KV
    heads are replicated 2 or 4 times."""
    check_matches(tiny_model_dir("llama-untied"), "llama-untied", tp, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_greedy_tokens_match_transformers_on_gpus(tiny_model_dir, name, tp):
    """The CUDA path: NCCL data plane between GPUs, float32, against the CPU reference."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s), found {torch.cuda.device_count()}")
    check_matches(tiny_model_dir(name), name, tp, device="cuda")
