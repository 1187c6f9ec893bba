"""Mixed greedy requests at once against a real two-rank server: none lost, each well-formed and equal to
its solo run, every KV block back in the pool. (benchmarks/reliability.py runs the same check with
1,000 requests at concurrency 64.)"""

from __future__ import annotations

from tests.reliability.load import run_load
from tests.reliability.workload import make_jobs


def test_mixed_requests_under_load_are_all_answered_well_formed_and_as_when_alone(load_server):
    jobs = make_jobs(48, seed=11, max_prompt_words=96, max_tokens=48)
    assert {(j.endpoint, j.stream) for j in jobs} == {("completions", False), ("completions", True),
                                                      ("chat", False), ("chat", True)}
    figures = run_load(load_server, jobs, concurrency=32)
    assert dict(figures.errors) == {}, figures.examples
    assert figures.lost == 0
    assert figures.answered == len(jobs)
    assert figures.leaked_blocks == 0, "KV blocks still held after every request finished"
    assert figures.preemptions > 0, "the batch did not outgrow the KV cache: preemption went untested"
