"""The start-up handshake: ranks that differ in environment or config refuse to start, naming what
differs; `--forward-env` ships rank 0's values to every rank so they cannot differ.

The two ranks are two `shardserve serve` processes started the way torchrun or two nodes start them
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each with its own environment.
"""

from __future__ import annotations

import openai

from shardserve.distributed.fingerprint import Fingerprint, differences
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.two_ranks import TwoRanks, serve_args

PROMPT = "w11 w22 w33 w44"


def test_differences_name_the_key_the_ranks_their_hosts_and_both_values():
    a = Fingerprint(0, "node-a", {"env.NCCL_ALGO": "<unset>", "torch.version": "2.13.0"})
    b = Fingerprint(1, "node-b", {"env.NCCL_ALGO": "Ring", "torch.version": "2.13.0"})
    c = Fingerprint(2, "node-b", {"torch.version": "2.13.0"})
    lines = differences([a, b, c])
    assert lines == ["NCCL_ALGO differs: rank 0 (node-a), rank 2 (node-b) have <unset>; rank 1 (node-b) has 'Ring'"]
    assert differences([a, Fingerprint(1, "node-b", dict(a.values))]) == []


def test_a_variable_set_on_one_rank_only_stops_start_up_naming_it(tiny_model_dir):
    ranks = TwoRanks(serve_args(tiny_model_dir("llama-untied")), env0={}, env1={"NCCL_ALGO": "Ring"})
    try:
        (code0, out0), (code1, out1) = ranks.wait_exit()
    finally:
        ranks.stop()
    assert code0 != 0 and code1 != 0, "both ranks must stop"
    for out in (out0, out1):
        assert "start-up stopped" in out
        assert "NCCL_ALGO differs:" in out and "rank 0 (" in out and "has <unset>" in out
        assert "rank 1 (" in out and "has 'Ring'" in out
        assert "--forward-env" in out, "the message says how to fix it"
    assert "loaded" not in out0 + out1, "the handshake runs before any weights load"


def test_forward_env_ships_rank0_values_so_the_ranks_start_and_serve(tiny_model_dir):
    model_dir = tiny_model_dir("llama-untied")
    with LLM(model_dir, kv_cache_memory_gb=0.05) as llm:
        expected = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    # Rank 0 (the launching node) has Tree, rank 1 has Ring; SHARDSERVE_PROBE is set on rank 0 only.
    args = serve_args(model_dir, "--forward-env", "NCCL_ALGO", "SHARDSERVE_PROBE")
    ranks = TwoRanks(args, env0={"NCCL_ALGO": "Tree", "SHARDSERVE_PROBE": "1"}, env1={"NCCL_ALGO": "Ring"})
    try:
        ranks.wait_healthy()
        client = openai.OpenAI(base_url=f"{ranks.url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
    finally:
        ranks.stop()
        out0 = ranks.procs[0].stdout.read()
    assert got == expected
    assert "forwarded to every rank: NCCL_ALGO=Tree, SHARDSERVE_PROBE=1" in out0
    assert "2 ranks run the same code, config and environment" in out0


def test_forward_env_names_are_checked_by_the_cli(capsys):
    from shardserve.cli import main

    try:
        main(["serve", "m", "--forward-env", "NCCL-ALGO"])
    except SystemExit as e:
        assert e.code == 2
    assert "--forward-env takes variable names" in capsys.readouterr().err


def test_host_specific_variables_compare_only_whether_they_are_set(monkeypatch):
    from shardserve.config import EngineConfig
    from shardserve.distributed.fingerprint import collect

    config = EngineConfig(model="m")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    on_a = collect(0, config)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ens3")
    on_b = collect(1, config)
    assert differences([on_a, on_b]) == [], "interface names differ from host to host"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert differences([on_a, collect(1, config)]) == [
        f"GLOO_SOCKET_IFNAME differs: rank 0 ({on_a.host}) has <set>; rank 1 ({on_a.host}) has <unset>"]


def test_secrets_never_enter_a_fingerprint(set_env):
    """Fingerprints cross the network in the clear: the control token and the API key stay out of them."""
    from shardserve.config import EngineConfig
    from shardserve.distributed.fingerprint import collect

    set_env(SHARDSERVE_CONTROL_TOKEN="token-secret-value")
    set_env(SHARDSERVE_API_KEY="key-secret-value")
    set_env(SHARDSERVE_OVERLAP_STEPS="1")  # an ordinary variable of the prefix: compared
    published = str(collect(0, EngineConfig(model="m")).to_json())
    assert "SHARDSERVE_OVERLAP_STEPS" in published
    assert "secret-value" not in published and "SHARDSERVE_API_KEY" not in published
