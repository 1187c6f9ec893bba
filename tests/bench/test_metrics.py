"""Per-level figures from request results, and the --goodput and other bench flags as the command
line parses them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardserve.bench.client import RequestResult
from shardserve.bench.metrics import Slo, client_bound_warning, parse_slo, summarize


def _result(ttft: float, e2e: float, tokens: int, prompt: int = 10) -> RequestResult:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1)
    return RequestResult(sent_s=0.0, ok=True, prompt_tokens=prompt, completion_tokens=tokens, usage_reported=True,
                         ttft_s=ttft, e2e_s=e2e, itl_s=gaps)


def test_summary_throughput_latency_and_goodput():
    results = [_result(0.1, 1.1, 11), _result(0.3, 2.3, 11), RequestResult(sent_s=0.0, error="HTTP 500: boom")]
    level = summarize(results, duration_s=2.5, concurrency=2, request_rate=None,
                      slos=(Slo("ttft", 200.0), Slo("tpot", 150.0)))
    assert (level.completed, level.failed, level.errors) == (2, 1, {"HTTP 500: boom": 1})
    assert level.total_input_tokens == 20 and level.total_output_tokens == 22
    assert level.request_throughput == pytest.approx(0.8)
    assert level.output_throughput == pytest.approx(22 / 2.5)
    assert level.total_token_throughput == pytest.approx(42 / 2.5)
    assert level.ttft_ms.mean == pytest.approx(200) and level.ttft_ms.p50 == pytest.approx(200)
    assert level.tpot_ms.p50 == pytest.approx(150)  # (1.0 s / 10, 2.0 s / 10) per token
    assert level.itl_ms.p90 == pytest.approx(200)
    assert level.goodput == pytest.approx(1 / 2.5), "only the first request met both SLOs"


def test_no_slos_no_goodput_and_no_results_no_latencies():
    level = summarize([RequestResult(sent_s=0.0, error="x")], duration_s=1.0, concurrency=1, request_rate=2.0)
    assert level.goodput is None and level.ttft_ms is None and level.completed == 0


@pytest.mark.parametrize("text, slo", [("ttft:500", Slo("ttft", 500.0)), ("tpot:12.5", Slo("tpot", 12.5)),
                                       ("e2el:3000", Slo("e2el", 3000.0))])
def test_parse_slo(text, slo):
    assert parse_slo(text) == slo


@pytest.mark.parametrize("args, expected", [
    (["--goodput", "ttft:abc"], "argument --goodput: --goodput takes KEY:MILLISECONDS with KEY one of ttft, tpot, "
                                "e2el (e.g. ttft:500), got 'ttft:abc': 'abc' is not a number"),
    (["--goodput", "itl:5"], "got 'itl:5'"),
    (["--goodput", "ttft:-1"], "the limit must be a positive number"),
    (["--concurrency", "1,0"], "--concurrency takes positive integers separated by commas (e.g. 1,4,16), got '1,0'"),
    (["--request-rate", "fast"], "--request-rate takes a positive number of requests/s or inf, got 'fast'"),
    (["--dataset", "d.jsonl", "--input-len", "5"], "--input-len applies to random prompts"),
    (["--input-len", "8", "--shared-prefix", "8"], "--shared-prefix (8) must be shorter than --input-len (8)"),
])
def test_bad_bench_flags_are_named_with_accepted_values(args, expected):
    run = subprocess.run([sys.executable, "-m", "shardserve", "bench", "--base-url", "http://127.0.0.1:1",
                          "--model", "m", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert expected in run.stderr


def test_a_client_busy_all_the_level_says_its_figures_are_its_own():
    results = [_result(0.1, 1.0, 10) for _ in range(4)]
    calm = summarize(results, 10.0, 4, None, client_cpu_s=2.0)
    busy = summarize(results, 10.0, 512, None, client_cpu_s=9.5)
    assert client_bound_warning([calm]) is None
    warning = client_bound_warning([calm, busy])
    assert "concurrency 512: 9.5 s of CPU in 10.0 s" in warning and "concurrency 4" not in warning
    assert "several bench processes" in warning


def test_the_advice_for_small_servers_comes_only_with_a_long_run():
    from shardserve.bench.main import announcement
    from shardserve.cli import parse_args

    flags = ["bench", "--base-url", "http://127.0.0.1:1", "--model", "m"]
    defaults = announcement(parse_args(flags))
    assert "4 levels x 64 requests, 128 output tokens each: 32,768 tokens to generate" in defaults
    assert "fewer do: --concurrency 1,4 --num-prompts 16 --output-len 32" in defaults
    advised = announcement(parse_args(flags + "--concurrency 1,4 --num-prompts 16 --output-len 32".split()))
    assert advised == "shardserve bench: 2 levels x 16 requests, 32 output tokens each: 1,024 tokens to generate"
