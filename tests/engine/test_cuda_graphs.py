"""The CUDA fast path keeps the tokens: graph replay equals eager execution, TP=2 equals TP=1, and every
all-reduce method gives the same tokens, all in float32 (runs on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from shardserve.distributed.all_reduce import FORCE_ENV, METHOD_NAMES
from shardserve.engine.sampling_params import SamplingParams
from shardserve.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64
# Mixed lengths: the decode batches shrink and grow across graph buckets, with padding rows.
PROMPT_LENGTHS = (3, 17, 33, 1, 50, 8, 120)


def _needs_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s), found {torch.cuda.device_count()}")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


_ONE_GPU_TOKENS: dict[str, list[list[int]]] = {}


def _one_gpu_reference(model_dir: str) -> list[list[int]]:
    """TP=1 graph-replayed tokens of a model, computed once per session (several tests compare against them)."""
    if model_dir not in _ONE_GPU_TOKENS:
        _ONE_GPU_TOKENS[model_dir] = _greedy(model_dir)
    return _ONE_GPU_TOKENS[model_dir]


def _greedy(model_dir: str, tp: int = 1, **options) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=tp, device="cuda", dtype="float32", kv_cache_memory_gb=0.05,
             **options) as llm:
        if not options.get("enforce_eager"):
            assert llm.engine.runner.graphs is not None, "CUDA graphs were not captured"
        return [out.token_ids for out in llm.generate(_prompts(), params)]


@pytest.mark.parametrize("name", ["llama-untied", "qwen3"])
def test_graph_replay_gives_the_same_tokens_as_eager(tiny_model_dir, name):
    _needs_gpus(1)
    model_dir = tiny_model_dir(name)
    assert _one_gpu_reference(model_dir) == _greedy(model_dir, enforce_eager=True)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_several_ranks_give_the_same_tokens_as_one(tiny_model_dir, tp):
    _needs_gpus(tp)
    model_dir = tiny_model_dir("llama-untied")
    assert _greedy(model_dir, tp=tp) == _one_gpu_reference(model_dir)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_all_reduce_method_gives_the_same_tokens(tiny_model_dir, monkeypatch, method):
    _needs_gpus(2)
    model_dir = tiny_model_dir("llama-tied")
    expected = _one_gpu_reference(model_dir)
    monkeypatch.setenv(FORCE_ENV, method)  # inherited by the spawned rank
    assert _greedy(model_dir, tp=2) == expected
