"""The interface the HTTP front end uses, declared once (requests/client.py): both engines behind it provide
every member, and the stats they report are the engine's own counts."""

from __future__ import annotations

import asyncio

from shardserve.engine.async_engine import AsyncEngine
from shardserve.entrypoints.llm import LLM
from shardserve.entrypoints.supervisor import Supervisor
from shardserve.requests.client import EngineClient, EngineStats
from shardserve.requests.sampling_params import SamplingParams


def _members() -> set[str]:
    return {n for n in dir(EngineClient) if not n.startswith("_")} | set(EngineClient.__annotations__)


def test_both_engines_provide_every_member_of_the_interface():
    for cls in (AsyncEngine, Supervisor):
        missing = {n for n in _members() - {"tokenizer", "max_model_len"} if not hasattr(cls, n)}
        assert not missing, f"{cls.__name__} lacks {sorted(missing)}"


def test_an_async_engine_is_an_engine_client_with_the_engines_counts(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-tied"), kv_cache_memory_gb=0.05)
    engine = AsyncEngine(lambda: llm.engine)
    try:
        assert isinstance(engine, EngineClient)

        async def one() -> None:
            async for _ in engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)):
                pass

        asyncio.run(one())
        stats = engine.stats()
        assert isinstance(stats, EngineStats) and stats.restarts is None
        assert stats.running == stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total > 0
        assert not stats.sleeping and stats.sleeps == 0
    finally:
        engine.shutdown()
        llm._teardown()
