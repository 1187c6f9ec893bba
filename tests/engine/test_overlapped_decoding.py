"""Overlapped decoding (the next decode step queued before the host has the tokens) changes no output:
the same tokens, finish reasons and logprobs as step-by-step decoding, including for sequences that stop
on a token mid-batch, hit their length limit at different steps, sample with seeds or get aborted, and
every KV block goes back to the pool. On GPUs it is on by default; here it is forced on the CPU path."""

from __future__ import annotations

import pytest

from shardserve.engine.llm_engine import OVERLAP_ENV
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams

PROMPTS = [[5, 9, 13], [40, 41], [7, 8, 9, 10, 11, 12], [100], [3, 3, 3, 3]]


def _engine(model_dir: str, overlap: bool, set_env, max_num_seqs: int = 8) -> LLM:
    set_env({OVERLAP_ENV: "1" if overlap else "0"})
    return LLM(model_dir, kv_cache_memory_gb=0.05, max_num_seqs=max_num_seqs)


def _run(llm: LLM, params: list[SamplingParams], abort_after: dict[int, int] | None = None):
    """Drive the engine by hand; abort_after maps a prompt index to the step after which it is aborted."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{i}", prompt, p)
    outputs: dict[str, object] = {}
    step = 0
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = out
        step += 1
        for i, after in (abort_after or {}).items():
            if step == after and f"r{i}" in engine.by_request:
                outputs[f"r{i}"] = engine.abort(f"r{i}")
    free, total = engine.block_manager.num_free_blocks, engine.runner.num_blocks
    return {rid: (o.token_ids, o.finish_reason, o.new_logprobs if o.new_logprobs else None)
            for rid, o in outputs.items()}, (free, total), engine.steps_overlapped


def _params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    ]


def test_overlapped_decoding_gives_the_same_outputs(tiny_model_dir, set_env):
    model_dir = tiny_model_dir("llama-untied")
    with _engine(model_dir, False, set_env) as llm:
        free_run, _, _ = _run(llm, _params(stop_token=-1))
        # A token prompt 1 really generates at its 6th step: stopping on it ends that sequence mid-batch.
        stop_token = free_run["r1"][0][5]
        expected, (free, total), overlapped = _run(llm, _params(stop_token))
    assert overlapped == 0 and free == total
    assert expected["r1"][1] == "stop" and len(expected["r1"][0]) <= 6
    with _engine(model_dir, True, set_env) as llm:
        got, (free, total), overlapped = _run(llm, _params(stop_token))
    assert overlapped > 10, "the steps were not overlapped"
    assert got == expected
    assert free == total, "a block allocated for a step computed ahead was not returned"


@pytest.mark.parametrize("abort_step", [1, 3])
def test_an_abort_while_a_step_is_in_flight_loses_nothing_else(tiny_model_dir, set_env, abort_step):
    model_dir = tiny_model_dir("llama-untied")
    params = _params(stop_token=-1)
    with _engine(model_dir, False, set_env) as llm:
        expected, _, _ = _run(llm, params, abort_after={0: abort_step})
    with _engine(model_dir, True, set_env) as llm:
        got, (free, total), overlapped = _run(llm, params, abort_after={0: abort_step})
    assert overlapped > 0 and free == total
    assert got["r0"][1] == "abort"
    # The aborted request still rode in the step computed ahead, so that step's batch was one row larger than
    # without overlap: tokens are the same, logprobs equal up to the last bits of a differently sized matmul.
    for rid in ("r1", "r2", "r3", "r4"):
        assert got[rid][:2] == expected[rid][:2], rid
        for a, b in zip(got[rid][2] or [], expected[rid][2] or []):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)


def test_two_ranks_overlapped_equal_step_by_step(tiny_model_dir, set_env):
    """At TP=2 rank 0 broadcasts the sampled tokens before each step computed ahead; rank 1 uses them."""
    model_dir = tiny_model_dir("llama-untied")
    params = _params(stop_token=-1)
    results = {}
    for overlap in (False, True):
        set_env({OVERLAP_ENV: "1" if overlap else "0"})
        with LLM(model_dir, tensor_parallel_size=2, kv_cache_memory_gb=0.05, max_num_seqs=8) as llm:
            results[overlap] = _run(llm, params)
    (expected, _, _), (got, (free, total), overlapped) = results[False], results[True]
    assert overlapped > 10 and free == total
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in expected.items()}


def test_requests_queued_behind_full_slots_are_served_the_same(tiny_model_dir, set_env):
    """With two sequence slots for five requests, the steps computed ahead go on while requests wait for a
    slot; each waiting request joins when one frees and gets the same tokens."""
    model_dir = tiny_model_dir("llama-untied")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 4, 7, 3, 6)]
    with _engine(model_dir, False, set_env, max_num_seqs=2) as llm:
        expected, _, _ = _run(llm, params)
    with _engine(model_dir, True, set_env, max_num_seqs=2) as llm:
        got, (free, total), overlapped = _run(llm, params)
    assert overlapped > 5 and free == total
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in expected.items()}


def test_prompts_in_chunks_and_late_arrivals_are_queued_ahead_too(tiny_model_dir, set_env):
    """With an 8-token step budget, prompts are computed in chunks beside decoding sequences and requests
    arrive while others run: nearly every step is queued before the host has the tokens of the one
    before, and the tokens are those of step-by-step scheduling."""
    model_dir = tiny_model_dir("llama-untied")
    prompts = [[(7 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate((19, 5, 12, 27, 9, 3))]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 11, 4, 9, 7, 5)]

    def run(overlap: bool):
        set_env({OVERLAP_ENV: "1" if overlap else "0"})
        with LLM(model_dir, kv_cache_memory_gb=0.05, max_num_seqs=4, max_num_batched_tokens=8) as llm:
            engine, outputs, steps = llm.engine, {}, 0
            for i in range(3):
                engine.add_request(f"r{i}", prompts[i], params[i])
            while engine.has_work():
                for out in engine.step():
                    outputs[out.request_id] = (out.token_ids, out.finish_reason)
                steps += 1
                if steps in (2, 5, 9):  # the other three arrive mid-run, one at a time
                    i = (2, 5, 9).index(steps) + 3
                    engine.add_request(f"r{i}", prompts[i], params[i])
            blocks = engine.block_manager.num_free_blocks, engine.runner.num_blocks
            return outputs, blocks, engine.steps_overlapped, steps

    expected, _, _, _ = run(False)
    got, (free, total), overlapped, steps = run(True)
    assert got == expected
    assert all(len(expected[f"r{i}"][0]) == p.max_tokens for i, p in enumerate(params))
    assert free == total, "a block allocated for a step planned ahead was not returned"
    assert overlapped >= steps - 8, f"only {overlapped} of {steps} steps were queued ahead"
