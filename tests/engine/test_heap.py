"""A running engine's start-up objects are out of the cyclic garbage collector's walks, and back once it stops."""

from __future__ import annotations

import gc

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams


def _tracked(obj) -> bool:
    """Whether the collector would walk obj in a collection (the permanent generation is not walked)."""
    return any(o is obj for o in gc.get_objects())


def test_start_up_objects_are_frozen_while_serving_and_released_at_shutdown(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-untied"), kv_cache_memory_gb=0.05)
    model = llm.engine.runner.model
    try:
        assert not _tracked(model) and not _tracked(llm.engine.scheduler), "start-up objects are walked by the collector"
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
        first = llm.generate([[1, 2, 3]], params)[0].token_ids
        gc.collect()  # a full collection while serving leaves the engine as it was
        assert llm.generate([[1, 2, 3]], params)[0].token_ids == first
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0
    assert _tracked(model), "a stopped engine's objects stay exempt from collection"
