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


def test_a_request_that_gives_up_while_the_model_sleeps_does_not_kill_the_engine(load_server):
    """POST /sleep, a completion whose client gives up while the model sleeps, POST /wake_up, then any
    request: answered (before: HTTP 500 KeyError, every rank restarted, one of --max-restarts used)."""
    import httpx
    import pytest

    body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=load_server, timeout=60) as http:
        before = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert http.post("/sleep", params={"level": "1"}).status_code == 200
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{load_server}/v1/completions", json={**body, "max_tokens": 64}, timeout=2)
        finally:
            assert http.post("/wake_up").status_code == 200
        after = http.post("/v1/completions", json=body)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before
        assert http.get("/health").status_code == 200
        restarts = [line for line in http.get("/metrics").text.splitlines()
                    if line.startswith("shardserve:restarts_total")]
        assert restarts and all(float(line.split()[-1]) == 0 for line in restarts), restarts
