"""`shardserve serve --data-parallel-size 2` on CPU: two replicas behind one endpoint. Prompts that share long
prefixes find more of them in the replicas' prefix caches with affinity routing than round-robin; with one replica killed while
16 streams run, every request ends (none hangs), the other replica keeps serving, and the dead one comes back;
/metrics labels each replica and sums them; /sleep and /wake_up reach both; the endpoint's API key is checked
once, in front."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
from shardserve.ipc.messages import STATUS_INTERVAL_S
from tests.serving import serve_cli, wait_until

NAME = "tiny"
# Four long "system prompts" (over 200 words: several routing chunks and KV blocks each), four questions each.
GROUPS = [" ".join(f"w{(g * 37 + i) % 250 + 5}" for i in range(220)) for g in range(4)]
PROMPT_TOKENS = 221


def _serve(model_dir: str, *flags: str):
    return serve_cli([model_dir, "-dp", "2", "--device", "cpu", "--served-model-name", NAME, "--kv-cache-memory",
                      "0.05", "--max-model-len", "512", *flags])


def _prefix_blocks_found(url: str) -> float:
    """The fraction of the prompts' whole KV blocks that the replicas found in their prefix caches (once the
    engines' counts have reached the front ends: they are sent every STATUS_INTERVAL_S)."""
    time.sleep(2 * STATUS_INTERVAL_S + 0.2)
    line = next(line for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith("shardserve:prefix_cache_hits_total") and 'replica="all"' in line)
    return float(line.rsplit(" ", 1)[1]) / (4 * len(GROUPS) * (PROMPT_TOKENS // 16))


def _ask_every_group(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for prefix in GROUPS:  # a group's four in a row: round-robin sends them to both replicas in turn
        for question in range(4):
            out = client.completions.create(model=NAME, prompt=f"{prefix} w{question + 1}", max_tokens=2)
            assert out.usage.prompt_tokens == PROMPT_TOKENS  # a token a word: the prompt is counted as sent


def test_affinity_routing_finds_more_prefixes_cached_than_round_robin(tiny_model_dir):
    rates = {}
    for policy in ("round-robin", "affinity"):
        with _serve(tiny_model_dir("llama-untied"), "--data-parallel-routing", policy) as url:
            _ask_every_group(url)
            rates[policy] = _prefix_blocks_found(url)
            routed = [r["requests"] for r in httpx.get(f"{url}/health").json()["replicas"]]
        assert sum(routed) == 4 * len(GROUPS) and min(routed) > 0, (policy, routed)  # both replicas served
    print(f"prompt blocks found in the prefix caches, {4 * len(GROUPS)} requests in {len(GROUPS)} prefix groups: "
          f"{rates}")
    # Round-robin computes each prefix on both replicas (2 of a group's 4 prompts find it), affinity on one (3 of 4).
    assert rates["affinity"] > rates["round-robin"] + 0.15, rates


def _stream(url: str, index: int) -> str:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": NAME, "prompt": f"w{index + 3} w7 w9", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as response:
            if response.status_code != 200:
                return f"status {response.status_code}"
            lines = list(response.iter_lines())
        return "done" if "data: [DONE]" in lines else "cut"
    except httpx.HTTPError as e:
        return f"error {type(e).__name__}"


def test_a_killed_replica_fails_only_its_own_requests_and_comes_back(tiny_model_dir):
    with _serve(tiny_model_dir("llama-untied"), "--data-parallel-routing", "least-loaded") as url:
        victim = httpx.get(f"{url}/health").json()["replicas"][1]["pid"]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_stream, url, i) for i in range(16)]
            assert wait_until(lambda: httpx.get(f"{url}/health").json()["replicas"][1]["outstanding_tokens"] > 0,
                              timeout=30)
            os.kill(victim, signal.SIGKILL)
            outcomes = [f.result(timeout=90) for f in futures]  # none hangs
        assert outcomes.count("done") >= 8, outcomes  # replica 0's half at least
        health = httpx.get(f"{url}/health").json()
        assert health["status"] in ("degraded", "ok") and health["replicas"][0]["serving"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for i in range(4):  # served meanwhile, by the replica that lives
            assert client.completions.create(model=NAME, prompt=f"w{i + 1} w2", max_tokens=3).usage.completion_tokens == 3
        assert wait_until(lambda: httpx.get(f"{url}/health").json()["status"] == "ok", timeout=120)
        back = httpx.get(f"{url}/health").json()["replicas"][1]
        assert back["restarts"] == 1 and back["pid"] != victim


def test_metrics_sleep_and_the_api_key_apply_to_every_replica(tiny_model_dir):
    with _serve(tiny_model_dir("llama-untied"), "--api-key", "front-key") as url:
        assert httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "w1"}).status_code == 401
        headers = {"Authorization": "Bearer front-key"}
        slept = httpx.post(f"{url}/sleep", headers=headers, timeout=60).json()["replicas"]
        assert [r["body"]["is_sleeping"] for r in slept] == [True, True]
        metrics = httpx.get(f"{url}/metrics", headers=headers).text
        assert 'shardserve:is_sleeping{model_name="tiny",replica="0"} 1.0' in metrics
        assert 'shardserve:is_sleeping{model_name="tiny",replica="all"} 2.0' in metrics
        woken = httpx.post(f"{url}/wake_up", headers=headers, timeout=60).json()["replicas"]
        assert [r["body"]["is_sleeping"] for r in woken] == [False, False]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="front-key")
        assert client.completions.create(model=NAME, prompt="w1 w2", max_tokens=2).usage.completion_tokens == 2


def test_data_parallel_on_several_machines_is_refused_by_name(tiny_model_dir):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "shardserve", "serve", tiny_model_dir("llama-untied"), "-dp", "2",
                             "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--nnodes is not supported with it" in result.stderr, result.stderr
