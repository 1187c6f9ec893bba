"""Clients that hang up mid-request or mid-stream, by close or by reset, while other requests run: the
engine drops the cut requests at once and every KV block comes back, the server stays healthy, and the
others get the answers they get alone. (benchmarks/reliability.py cuts 200 streams.)"""

from __future__ import annotations

from tests.reliability.disconnects import CUT_POINTS, cut_jobs, run_disconnects
from tests.reliability.workload import make_jobs

IDLE_WITHIN_S = 3.0


def test_cut_streams_give_back_every_block_and_leave_other_requests_untouched(load_server):
    cuts = cut_jobs(48, seed=21, max_prompt_words=32)
    others = make_jobs(16, seed=22, max_prompt_words=64, max_tokens=16)
    figures = run_disconnects(load_server, cuts, others, concurrency=24, seed=23)
    assert {point.split("/")[0] for point in figures.cut_points} == set(CUT_POINTS)
    assert figures.leaked_blocks == 0, "cut streams kept KV blocks"
    # Aborted requests leave at the engine's next step; un-aborted ones would generate for seconds more.
    assert figures.idle_after_s < IDLE_WITHIN_S, "cut requests kept running: the server did not abort them"
    assert figures.healthy_after
    assert dict(figures.others.errors) == {}, figures.others.examples
    assert figures.others.answered == len(others)
