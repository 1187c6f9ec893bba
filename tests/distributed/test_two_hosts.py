"""Two hosts on one machine: two network namespaces joined by a veth pair, one rank in each, serving a
model at TP=2 with `--nnodes 2`; the greedy tokens equal TP=1's. Needs root and `ip` (iproute2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from shardserve.distributed.process_group import find_free_port
from shardserve.engine.sampling_params import SamplingParams
from shardserve.entrypoints.llm import LLM

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


def test_one_rank_on_each_of_two_hosts_gives_the_tokens_of_one_rank(tiny_model_dir, two_hosts):
    model_dir = tiny_model_dir("llama-untied")
    with LLM(model_dir, kv_cache_memory_gb=0.05) as llm:
        expected = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    (ns_a, addr_a, dev_a), (ns_b, _, dev_b) = two_hosts
    master_port, http_port = find_free_port(), find_free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_", "SHARDSERVE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    nodes = []
    for node_rank, (ns, dev) in enumerate(((ns_a, dev_a), (ns_b, dev_b))):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "shardserve", "serve", model_dir, "-tp", "2",
               "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", addr_a,
               "--master-port", str(master_port), "--control-interface", dev, "--device", "cpu",
               "--host", addr_a, "--port", str(http_port), "--served-model-name", "tiny", "--kv-cache-memory", "0.05"]
        nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        client = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", CLIENT,
                                 f"http://{addr_a}:{http_port}", PROMPT],
                                env=env, capture_output=True, text=True, timeout=240)
    finally:
        for node in nodes:
            node.terminate()
        logs = []
        for node in nodes:
            try:
                logs.append(node.communicate(timeout=30)[0])
            except subprocess.TimeoutExpired:
                node.kill()
                logs.append(node.communicate()[0])
    assert client.returncode == 0, f"client: {client.stderr}\nnode 0:\n{logs[0][-3000:]}\nnode 1:\n{logs[1][-3000:]}"
    assert json.loads(client.stdout) == expected
    assert "2 ranks run the same code, config and environment" in logs[0]
