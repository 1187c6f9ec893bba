"""/metrics: Prometheus text that prometheus_client parses, whose counters move with the requests served
and agree with the token counts in the responses' usage."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import serve_model, wait_until

LONG = 200  # tokens a request cut short by its client cannot have generated before it went away


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """Two ranks behind the HTTP app, for this module (the counters are compared before and after)."""
    with serve_model(tiny_model_dir("llama-untied"), tp=2, name="tiny") as running:
        yield running


def _scrape(server) -> dict[str, dict[tuple, float]]:
    text = server.http().get("/metrics").text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def _value(samples, name: str, **labels) -> float:
    return sum(v for key, v in samples.get(name, {}).items() if all(dict(key).get(k) == x for k, x in labels.items()))


def _moved(before, after, name: str, **labels) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def test_counters_move_with_the_requests_and_match_usage(server):
    before = _scrape(server)
    assert _value(before, "shardserve:num_requests_running", model_name="tiny") == 0
    client = server.openai()
    prompt_tokens = completion_tokens = 0
    long = " ".join(f"w{i}" for i in range(40))  # over two KV blocks: its prefix can be cached
    for prompt in (long, "w4 w5", "w6 w7 w8 w9"):
        usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}).usage
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
    streamed = list(client.completions.create(model="tiny", prompt=long, max_tokens=5, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    usage = streamed[-1].usage
    prompt_tokens += usage.prompt_tokens
    completion_tokens += usage.completion_tokens

    after = _scrape(server)
    assert _moved(before, after, "shardserve:prompt_tokens_total", model_name="tiny") == prompt_tokens
    assert _moved(before, after, "shardserve:generation_tokens_total", model_name="tiny") == completion_tokens
    assert _moved(before, after, "shardserve:request_success_total", finished_reason="length") == 4
    assert _moved(before, after, "shardserve:request_success_total") == 4, "each request counted once"
    assert _moved(before, after, "shardserve:time_to_first_token_seconds_count") == 4
    assert _moved(before, after, "shardserve:e2e_request_latency_seconds_count") == 4
    assert _moved(before, after, "shardserve:inter_token_latency_seconds_count") >= 4, "the stream's tokens came apart"
    assert _moved(before, after, "shardserve:prefix_cache_queries_total") > 0
    assert _moved(before, after, "shardserve:prefix_cache_hits_total") > 0, "the repeated prompt hit the prefix cache"
    assert 0 <= _value(after, "shardserve:kv_cache_usage_perc") <= 1

    server.http().post("/sleep", params={"level": "1"})
    server.http().post("/wake_up")
    slept = _scrape(server)
    assert _moved(after, slept, "shardserve:sleeps_total") == 1 and _moved(after, slept, "shardserve:wakes_total") == 1
    assert _value(slept, "shardserve:last_wake_seconds") > 0


def test_a_request_whose_client_disconnects_mid_stream_counts_as_aborted(server):
    before = _scrape(server)
    stream = server.openai().completions.create(model="tiny", prompt="w4 w5", max_tokens=LONG, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()

    def aborted() -> float:
        return _moved(before, _scrape(server), "shardserve:request_success_total", finished_reason="abort")

    assert wait_until(lambda: aborted() == 1), f"aborted requests counted: {aborted()}, not 1"
    after = _scrape(server)
    assert _moved(before, after, "shardserve:request_success_total") == 1, "counted once, as abort only"
    assert _moved(before, after, "shardserve:e2e_request_latency_seconds_count") == 0
