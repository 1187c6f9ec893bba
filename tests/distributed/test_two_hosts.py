"""Two hosts on one machine: two network namespaces joined by a veth pair, one rank in each, serving a
model at TP=2, or in two pipeline stages, one a host, with `--nnodes 2`; the greedy tokens equal TP=1's, and a
stage's rank killed on its host fails the server within 10 s naming it. Needs root and `ip` (iproute2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from shardserve.distributed.process_group import find_free_port
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams

PROMPT = "w5 w17 w99 w3"
SUBNET = "10.231.{}.{}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """[(namespace, address, interface)] for host a and host b, removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the `ip` command (iproute2)")
    tag = os.getpid() % 10000
    hosts = [(f"ssn{tag}{side}", SUBNET.format(tag % 250, i + 1), f"ssv{tag}{side}") for i, side in enumerate("ab")]
    made = []
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for ns, address, dev in hosts:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"network namespaces can't be made here: {' '.join(e.cmd)}: {e.stderr.strip()}")
    try:
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


CLIENT = textwrap.dedent("""
    import json, sys, time
    import httpx, openai
    url = sys.argv[1]
    deadline = time.monotonic() + 150
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            sys.exit("the server did not become healthy")
        time.sleep(0.5)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt=sys.argv[2], max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    print(json.dumps(out.choices[0].text))
""")


def _start_nodes(model_dir: str, hosts, extra_args: list[str], node_env: list[dict[str, str]],
                 layout: tuple[str, ...] = ("-tp", "2")):
    (ns_a, addr_a, _), _ = hosts
    master_port, http_port = find_free_port(), find_free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_", "SHARDSERVE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["SHARDSERVE_CONTROL_TOKEN"] = "test-control-token"  # the launch's shared secret, set on both hosts
    nodes = []
    for node_rank, (ns, _, dev) in enumerate(hosts):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "shardserve", "serve", model_dir, *layout,
               "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", addr_a,
               "--master-port", str(master_port), "--control-interface", dev, "--device", "cpu",
               "--host", addr_a, "--port", str(http_port), "--served-model-name", "tiny", "--kv-cache-memory", "0.05",
               *extra_args]
        nodes.append(subprocess.Popen(cmd, env={**env, **node_env[node_rank]}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return nodes, f"http://{addr_a}:{http_port}", env


def _stop(nodes) -> list[str]:
    for node in nodes:
        node.terminate()
    logs = []
    for node in nodes:
        try:
            logs.append(node.communicate(timeout=30)[0])
        except subprocess.TimeoutExpired:
            node.kill()
            logs.append(node.communicate()[0])
    return logs


def test_one_rank_on_each_of_two_hosts_gives_the_tokens_of_one_rank(tiny_model_dir, two_hosts):
    """Node b's NCCL_ALGO differs, but node a forwards its own value, so the hosts agree and serve."""
    model_dir = tiny_model_dir("llama-untied")
    with LLM(model_dir, kv_cache_memory_gb=0.05) as llm:
        expected = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    nodes, url, env = _start_nodes(model_dir, two_hosts, ["--forward-env", "NCCL_ALGO"],
                                   [{"NCCL_ALGO": "Tree"}, {"NCCL_ALGO": "Ring"}])
    try:
        client = subprocess.run(["ip", "netns", "exec", two_hosts[0][0], sys.executable, "-c", CLIENT, url, PROMPT],
                                env=env, capture_output=True, text=True, timeout=240)
    finally:
        logs = _stop(nodes)
    assert client.returncode == 0, f"client: {client.stderr}\nnode 0:\n{logs[0][-3000:]}\nnode 1:\n{logs[1][-3000:]}"
    assert json.loads(client.stdout) == expected
    assert "forwarded to every rank: NCCL_ALGO=Tree" in logs[0]
    assert "2 ranks run the same code, config and environment" in logs[0]
    assert f"step plans go to 1 rank(s) over TCP connections to {two_hosts[0][1]}" in logs[0]  # across the hosts


def test_a_variable_that_differs_between_the_hosts_refuses_start_up(tiny_model_dir, two_hosts):
    nodes, _, _ = _start_nodes(tiny_model_dir("llama-untied"), two_hosts, [], [{}, {"NCCL_ALGO": "Ring"}])
    try:
        codes = [node.wait(timeout=120) for node in nodes]
    finally:
        logs = _stop(nodes)
    assert codes[0] != 0 and codes[1] != 0
    for log in logs:
        assert "NCCL_ALGO differs: rank 0 (" in log and "has <unset>; rank 1 (" in log and "has 'Ring'" in log


def test_a_pipeline_stage_on_each_host_gives_one_ranks_tokens_and_its_death_is_named(tiny_model_dir, two_hosts):
    """`-pp 2 --nnodes 2 --max-restarts 0`: stage 0 on host a, stage 1 on host b (the residual stream crosses the
    veth link); the greedy tokens are TP=1's. Then host b's node (stage 1's rank) is killed: within 10 s host a's
    server stops answering /health with 200 and exits with status 1, its log naming the rank and its stage."""
    import time

    import httpx

    model_dir = tiny_model_dir("llama-untied")
    with LLM(model_dir, kv_cache_memory_gb=0.05) as llm:
        expected = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    nodes, url, env = _start_nodes(model_dir, two_hosts, ["--max-restarts", "0"], [{}, {}], layout=("-pp", "2"))
    ns_a = two_hosts[0][0]
    try:
        client = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", CLIENT, url, PROMPT], env=env,
                                capture_output=True, text=True, timeout=240)
        assert client.returncode == 0, f"client: {client.stderr}"
        assert json.loads(client.stdout) == expected
        _kill_tree(nodes[1].pid)  # the node of host b: stage 1's rank
        killed = time.monotonic()
        health = [sys.executable, "-c", f"import httpx; print(httpx.get('{url}/health', timeout=2).status_code)"]
        while nodes[0].poll() is None:
            probe = subprocess.run(["ip", "netns", "exec", ns_a, *health], capture_output=True, text=True)
            if probe.stdout.strip() != "200":
                break
            assert time.monotonic() - killed < 10, "host a still answers 200 10 s after stage 1's rank died"
            time.sleep(0.2)
        assert nodes[0].wait(timeout=60) == 1
    except (AssertionError, subprocess.TimeoutExpired, httpx.HTTPError) as failure:
        logs = _stop(nodes)
        raise AssertionError(f"{failure}\nnode 0:\n{logs[0][-3000:]}\nnode 1:\n{logs[1][-3000:]}") from None
    logs = _stop(nodes)
    assert "the plan connection to rank 1 (pipeline stage 1 of 2, tensor-parallel rank 0) failed" in logs[0], \
        logs[0][-3000:]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it (host b's node: its rank and anything it started)."""
    from pathlib import Path

    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            todo += [int(child) for child in (task / "children").read_text().split()]
    for victim in found:
        os.kill(victim, 9)
