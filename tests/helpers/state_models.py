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


def greedy_choices_over_http(model_dir: str, prompt: list[int], n: int, max_tokens: int) -> dict:
    """The response body of a greedy completion of `prompt` with `n` choices from a real server of the model (a
    float32 CPU engine of 4 sequences, as cpu_llm's), which must have every KV block free afterwards."""
    from tests.serving import serve_model

    with serve_model(model_dir, name="tiny", device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
                     max_num_seqs=4) as server:
        with server.http() as http:
            body = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "n": n, "temperature": 0,
                                                       "max_tokens": max_tokens, "ignore_eos": True}).json()
        assert server.all_blocks_free(), "a KV block leaked"
    return body

