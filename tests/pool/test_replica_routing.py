"""Choosing a data-parallel replica: prompts that share a prefix go where it was sent, unless that replica is much
busier; outstanding tokens balance the rest; round-robin takes turns; dead replicas are never chosen. And what the
router passes on: replicas' flags without the endpoint's API key, their devices, their metrics labelled and summed."""

from __future__ import annotations

import pytest

from shardserve.pool.replica_routing import (AFFINITY_SLACK_TOKENS, PREFIX_CHUNK_CHARS, ReplicaRouter,
                                             prefix_hashes, prompt_text, request_cost)
from shardserve.pool.replicas import merged_metrics, replica_argv, replica_devices

SYSTEM = "You are a careful assistant. " * 40  # a shared system prompt of several chunks


def _chat(question: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 16}


def test_prompts_that_share_a_prefix_share_its_leading_hashes_only():
    a, b = prefix_hashes(prompt_text(_chat("What is 2 + 2?"))), prefix_hashes(prompt_text(_chat("Name a colour.")))
    shared = len(SYSTEM) // PREFIX_CHUNK_CHARS
    assert a[:shared] == b[:shared] and a[-1] != b[-1]
    assert prompt_text({"prompt": "w1 w2"}) == "w1 w2" and prompt_text({"prompt": [1, 2]}) == "[1, 2]"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]}
    assert "hi!" in prompt_text(parts)


def test_a_request_costs_its_prompt_and_its_completion_limit():
    assert request_cost({"max_tokens": 100, "n": 2}, "x" * 400) == 100 + 200
    assert request_cost({"max_completion_tokens": 7}, "") == 7


def test_affinity_keeps_a_prefix_on_its_replica_and_spreads_the_others():
    router = ReplicaRouter(2)
    first = prefix_hashes(prompt_text(_chat("q1")))
    assert router.choose(first, [0, 1]) == 0
    router.sent(0, first, 500)
    other = prefix_hashes(prompt_text({"prompt": "an unrelated prompt " * 30}))
    assert router.choose(other, [0, 1]) == 1  # no shared prefix: the least loaded
    router.sent(1, other, 500)
    router.sent(1, prefix_hashes("more work"), 1000)
    assert router.choose(prefix_hashes(prompt_text(_chat("q2"))), [0, 1]) == 0  # the system prompt's replica


def test_a_much_busier_replica_loses_its_prefix_to_the_least_loaded():
    router = ReplicaRouter(2)
    hashes = prefix_hashes(prompt_text(_chat("q")))
    router.sent(0, hashes, AFFINITY_SLACK_TOKENS)
    assert router.choose(hashes, [0, 1]) == 0  # busier by exactly the slack: still there
    router.sent(0, prefix_hashes("x"), 1)
    assert router.choose(hashes, [0, 1]) == 1
    router.finished(0, AFFINITY_SLACK_TOKENS + 1)
    assert router.choose(hashes, [0, 1]) == 0


def test_dead_replicas_are_never_chosen_and_forget_their_prefixes():
    router = ReplicaRouter(3, "round-robin")
    assert [router.choose([], [0, 2]) for _ in range(4)] == [0, 2, 0, 2]
    router = ReplicaRouter(3)
    hashes = prefix_hashes(SYSTEM)
    router.sent(1, hashes, 10)
    assert router.choose(hashes, [0, 2]) in (0, 2)
    router.forget(1)
    router.finished(1, 10)
    assert router.matched_chunks(1, hashes) == 0 and router.choose(hashes, [0, 1, 2]) == 0
    with pytest.raises(ValueError, match="no live replica"):
        router.choose(hashes, [])
    with pytest.raises(ValueError, match="affinity, least-loaded, round-robin"):
        ReplicaRouter(2, "random")


def test_least_loaded_balances_outstanding_tokens():
    router = ReplicaRouter(3, "least-loaded")
    for cost in (300, 100, 200, 50):
        i = router.choose(prefix_hashes(SYSTEM), [0, 1, 2])
        router.sent(i, [], cost)
    assert router.outstanding == [300, 150, 200]


def test_replicas_get_every_flag_but_the_api_key():
    argv = ["m", "-tp", "2", "--api-key", "secret", "--port", "9000", "--api-key=other", "--seed", "3"]
    assert replica_argv(argv) == ["m", "-tp", "2", "--port", "9000", "--seed", "3"]


def test_each_replica_takes_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_devices(2, 2, "cuda") == [["4", "5"], ["6", "7"]]
    assert replica_devices(3, 1, "cpu") == [None, None, None]
    with pytest.raises(ValueError, match="--data-parallel-size 3 x --tensor-parallel-size 2 needs 6 GPUs; 4"):
        replica_devices(3, 2, "cuda")


def test_metrics_are_labelled_by_replica_and_summed():
    text = ('# HELP shardserve:prefix_cache_hits Blocks found.\n# TYPE shardserve:prefix_cache_hits counter\n'
            'shardserve:prefix_cache_hits_total{model_name="m"} %s\n')
    merged = merged_metrics({0: text % 3.0, 1: text % 4.0})
    assert 'shardserve:prefix_cache_hits_total{model_name="m",replica="0"} 3.0' in merged
    assert 'shardserve:prefix_cache_hits_total{model_name="m",replica="1"} 4.0' in merged
    assert 'shardserve:prefix_cache_hits_total{model_name="m",replica="all"} 7.0' in merged
    assert merged.count("# TYPE shardserve:prefix_cache_hits counter") == 1
