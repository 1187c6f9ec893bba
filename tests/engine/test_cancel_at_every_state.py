"""A request cancelled in any state it can be in (queued, prefilling, decoding with a step in flight,
preempted, held while the engine sleeps, deferred by a pending sleep) leaves nothing behind: the engine
keeps serving, the other requests get the tokens they get alone, and every KV block comes back."""

from __future__ import annotations

import asyncio

import pytest

from shardserve.engine.async_engine import AsyncEngine
from shardserve.engine.sequence import SequenceStatus
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams

MODEL = "llama-untied"
OTHER = [7, 8, 9, 10, 11]
LONG = [(5 * i) % 900 + 3 for i in range(60)]  # prefilled over several steps of 16 tokens
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_model_dir) -> list[int]:
    with LLM(tiny_model_dir(MODEL), kv_cache_memory_gb=0.05) as llm:
        return llm.generate([OTHER], PARAMS)[0].token_ids


def _finish(engine) -> dict[str, list[int]]:
    """Step until idle; the tokens of every request that finished."""
    done = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def _assert_clean(engine, done: dict[str, list[int]], alone: list[int]) -> None:
    assert done.get("other") == alone, "the request beside the cancelled one changed"
    assert "victim" not in engine.by_request and not engine.held
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"


def _until(engine, condition, limit: int = 200) -> None:
    for _ in range(limit):
        if condition():
            return
        engine.step()
    raise AssertionError("the state to cancel in was never reached")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("state", ["queued", "prefilling", "decoding"])
def test_cancel_while_queued_prefilling_or_decoding(tiny_model_dir, alone, state, overlap):
    with LLM(tiny_model_dir(MODEL), kv_cache_memory_gb=0.05, max_num_batched_tokens=16) as llm:
        engine = llm.engine
        engine.overlap_steps = overlap
        engine.add_request("other", OTHER, PARAMS)
        engine.add_request("victim", LONG, PARAMS)
        victim = engine.by_request["victim"]
        if state == "prefilling":
            _until(engine, lambda: 0 < victim.num_computed_tokens < len(LONG))
        elif state == "decoding":
            _until(engine, lambda: victim.num_output_tokens >= 2)
            assert overlap is False or engine._in_flight is not None, "cancel with a step in flight"
        engine.abort("victim")
        _assert_clean(engine, _finish(engine), alone)


def test_cancel_while_preempted(tiny_model_dir, alone):
    probe = LLM(tiny_model_dir(MODEL), kv_cache_memory_gb=0.05)
    per_block = probe.engine.runner._kv_bytes_per_block()
    probe.shutdown()
    # 8 blocks of 16 tokens: four requests of 20 + 24 tokens need 11, so the latest admitted is preempted.
    with LLM(tiny_model_dir(MODEL), kv_cache_memory_gb=8 * per_block / 2**30, max_model_len=64) as llm:
        engine = llm.engine
        engine.add_request("other", OTHER, PARAMS)
        for i in range(2):
            engine.add_request(f"filler{i}", [i + 3] * 20, PARAMS)
        engine.add_request("victim", [4] * 20, PARAMS)
        victim = engine.by_request["victim"]
        _until(engine, lambda: engine.scheduler.num_preemptions > 0 and victim.status is SequenceStatus.WAITING
               and victim.num_output_tokens > 0)
        engine.abort("victim")
        _assert_clean(engine, _finish(engine), alone)


def test_cancel_while_asleep_then_wake_and_serve(tiny_model_dir, alone):
    """The reported crash: a request that gives up while the engine sleeps, then a wake, then any request
    (before: KeyError in _launch, the engine dead, a restart used)."""
    with LLM(tiny_model_dir(MODEL), kv_cache_memory_gb=0.05) as llm:
        engine = llm.engine
        engine.sleep(1)
        engine.add_request("victim", LONG, PARAMS)  # held until the wake
        engine.abort("victim")
        engine.wake_up()
        engine.add_request("other", OTHER, PARAMS)
        _assert_clean(engine, _finish(engine), alone)


def test_cancel_while_deferred_by_a_pending_sleep(tiny_model_dir, alone):
    """A sleep asked for while a request runs waits for it; a request that arrives meanwhile is deferred, and
    one cancelled there must not be added when the sleep happens (nor run after the wake)."""
    llm = LLM(tiny_model_dir(MODEL), kv_cache_memory_gb=0.05)
    engine = AsyncEngine(lambda: llm.engine)

    async def scenario() -> list[int]:
        async def collect(request_id, prompt):
            tokens = []
            async for out in engine.generate(request_id, prompt, PARAMS):
                tokens = out.token_ids
            return tokens

        running = asyncio.create_task(collect("running", OTHER))
        await asyncio.sleep(0.05)
        sleeping = asyncio.create_task(engine.sleep(1))
        victim = asyncio.create_task(collect("victim", LONG))
        await asyncio.sleep(0.05)
        victim.cancel()  # the client gives up: generate's cleanup queues the abort
        await asyncio.gather(victim, return_exceptions=True)
        await running
        await sleeping
        await engine.wake_up()
        return await collect("other", OTHER)

    try:
        assert asyncio.run(scenario()) == alone
        assert "victim" not in llm.engine.by_request and not llm.engine.held
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        assert engine.error is None
    finally:
        engine.shutdown()
        llm._teardown()
