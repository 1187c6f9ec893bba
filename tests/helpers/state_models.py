"""What the tests of models with per-sequence recurrent states (Qwen3-Next, Qwen3.5, NemotronH), and of DeepSeek's
latent cache, share: a float32 CPU engine with a small KV cache, greedy sampling, and the check that every KV block
and state slot is back."""

from __future__ import annotations

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams


def cpu_llm(model_dir: str, **options) -> LLM:
    """A float32 CPU engine of 4 sequences over 0.01 GB of KV cache, unless `options` say otherwise."""
    return LLM(model_dir, device="cpu", dtype="float32", **{"kv_cache_memory_gb": 0.01, "max_num_seqs": 4, **options})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def assert_all_returned(llm: LLM) -> None:
    """Every KV block back in the free pool and every state slot free (where the model keeps states)."""
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "a KV block leaked"
    if engine.scheduler.free_slots is None:
        return
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs)), "a state slot leaked"
