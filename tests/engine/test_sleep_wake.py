"""Sleep and wake on CPU (the GPU path is the same code, with pinned host memory): outputs stay
bit-identical to a model that never slept, memory stays flat, and weights changed while asleep are
caught by the canary and reloaded from the checkpoint."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams

PROMPTS = ["w1 w2 w3", "w40 w41"]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_twenty_alternating_cycles_between_two_models_stay_bit_identical_with_flat_memory(tiny_model_dir):
    a = LLM(tiny_model_dir("llama-untied"), kv_cache_memory_gb=0.05)
    b = LLM(tiny_model_dir("qwen3"), kv_cache_memory_gb=0.05)
    try:
        expected = {"a": _tokens(a), "b": _tokens(b)}
        b.sleep(1)
        rss = []
        for cycle in range(20):
            awake, asleep = (a, b) if cycle % 2 == 0 else (b, a)
            name = "a" if awake is a else "b"
            assert _tokens(awake) == expected[name], f"cycle {cycle}: model {name} changed"
            awake.sleep(1 + cycle % 4 // 3)  # mostly level 1, every fourth cycle level 2
            asleep.wake_up()
            gc.collect()
            rss.append(_rss_bytes())
        assert max(rss[1:]) - rss[1] < 64 * 2**20, f"memory grew over the cycles: {[r >> 20 for r in rss]} MiB"
        assert a.engine.canary_reloads == 0 and b.engine.canary_reloads == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_asleep_the_weights_leave_the_working_copy(tiny_model_dir):
    with LLM(tiny_model_dir("llama-tied"), kv_cache_memory_gb=0.05) as llm:
        working = lambda: sum(p.numel() for p in llm.engine.runner.model.parameters())  # noqa: E731
        loaded = working()
        llm.sleep(1)
        assert llm.is_sleeping and working() == 0 and llm.engine.runner.kv_caches is None
        assert llm.engine.runner.host_weights.nbytes > 0
        llm.wake_up()
        assert working() == loaded and not llm.is_sleeping


def test_tp2_sleeps_and_wakes_on_every_rank(tiny_model_dir):
    with LLM(tiny_model_dir("llama-untied"), tensor_parallel_size=2, kv_cache_memory_gb=0.05) as llm:
        expected = _tokens(llm)
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert _tokens(llm) == expected


def test_weights_changed_while_asleep_fail_the_canary_and_are_reloaded(tiny_model_dir):
    with LLM(tiny_model_dir("llama-untied"), kv_cache_memory_gb=0.05) as llm:
        expected = _tokens(llm)
        llm.sleep(1)
        with torch.no_grad():  # bit rot in the host copy
            for key, tensor in llm.engine.runner.host_weights.tensors.items():
                if "layers.0" in key[0] and tensor.is_floating_point():
                    tensor.mul_(-3.0)
        llm.wake_up()
        assert llm.engine.canary_reloads == 1
        assert _tokens(llm) == expected


def test_partial_wake_and_requests_while_asleep(tiny_model_dir):
    with LLM(tiny_model_dir("qwen2"), kv_cache_memory_gb=0.05) as llm:
        expected = _tokens(llm)
        llm.sleep(1)
        with pytest.raises(RuntimeError, match="the engine is asleep: call wake_up"):
            _tokens(llm)
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping, "the KV cache still sleeps"
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping and _tokens(llm) == expected
        with pytest.raises(ValueError, match="wake_up tags are 'weights' and 'kv_cache', got \\['kv'\\]"):
            llm.wake_up(tags=["kv"])
    with LLM(tiny_model_dir("qwen2"), kv_cache_memory_gb=0.05, wake_on_request=True) as llm:
        llm.sleep(2)
        assert _tokens(llm) == expected, "a request to a sleeping engine wakes it and is served"
        assert not llm.is_sleeping
