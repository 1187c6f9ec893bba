"""A request's outputs wait for a slow consumer merged into one, in order; an error ends the request."""

from __future__ import annotations

import asyncio

from shardserve.requests.output_collector import OutputCollector
from shardserve.requests.outputs import RequestOutput, TokenLogprob


def _out(i: int, finished: bool = False, logprobs: bool = False) -> RequestOutput:
    ids = list(range(i + 1))
    return RequestOutput("r", [7, 8], ids, "".join(f"t{j}" for j in ids), [i], f"t{i}",
                         [TokenLogprob(i, -float(i))] if logprobs else None, finished, "stop" if finished else None)


def test_outputs_taken_one_by_one_stay_apart():
    async def run():
        c = OutputCollector()
        got = []
        for i in range(3):
            c.put(_out(i))
            got.append(await c.get())
        return got
    got = asyncio.run(run())
    assert [o.new_token_ids for o in got] == [[0], [1], [2]]


def test_outputs_that_pile_up_merge_in_order():
    async def run():
        c = OutputCollector()
        for i in range(4):
            c.put(_out(i, finished=i == 3, logprobs=i != 1))
        return await c.get()
    merged = asyncio.run(run())
    assert merged.new_token_ids == [0, 1, 2, 3]
    assert merged.delta_text == "t0t1t2t3" and merged.text == "t0t1t2t3"
    assert merged.token_ids == [0, 1, 2, 3] and merged.num_prompt_tokens == 2
    assert [lp.token_id for lp in merged.new_logprobs] == [0, 2, 3]
    assert merged.finished and merged.finish_reason == "stop"


def test_a_consumer_waiting_first_wakes_on_put():
    async def run():
        c = OutputCollector()
        waiter = asyncio.ensure_future(c.get())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        c.put(_out(0))
        return await asyncio.wait_for(waiter, 1)
    assert asyncio.run(run()).new_token_ids == [0]


def test_an_error_replaces_waiting_output_and_wins_over_later_ones():
    async def run():
        c = OutputCollector()
        c.put(_out(0))
        c.put(RuntimeError("engine died"))
        c.put(_out(1))
        return await c.get()
    got = asyncio.run(run())
    assert isinstance(got, RuntimeError) and "engine died" in str(got)
