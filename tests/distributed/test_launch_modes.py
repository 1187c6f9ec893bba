"""How `serve` finds its place among the ranks: --nnodes/--node-rank, srun (a task per rank or per
node), torchrun, or all ranks on this machine."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import openai
import pytest

from shardserve.distributed.launcher import LaunchInfo, NodeLaunch, expand_hostlist, slurm_launch
from shardserve.distributed.process_group import find_free_port
from shardserve.entrypoints.llm import LLM
from shardserve.entrypoints.serve import choose_launch
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.two_ranks import TwoRanks

SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_LOCALID": "1",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}


def test_slurm_host_lists_expand():
    assert expand_hostlist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_hostlist("b[9-11]") == ["b9", "b10", "b11"]
    assert expand_hostlist("n[1-2]-ib,x") == ["n1-ib", "n2-ib", "x"]


def test_srun_with_a_task_per_rank_meets_on_the_first_node():
    launch = slurm_launch(4, None, None, env=SLURM)
    assert launch == LaunchInfo(rank=1, world_size=4, init_method="tcp://gpu07:29956", local_rank=1,
                                local_world_size=2)
    assert slurm_launch(4, "10.0.0.5", 7000, env=SLURM).init_method == "tcp://10.0.0.5:7000"


def test_srun_with_a_task_per_node_starts_the_nodes_ranks():
    env = {**SLURM, "SLURM_NTASKS": "2"}
    launch = slurm_launch(8, None, None, env=env)
    assert launch == NodeLaunch(world_size=8, nnodes=2, node_rank=1, init_method="tcp://gpu07:29956")
    assert (launch.first_rank, launch.per_node) == (4, 4)


def test_srun_with_another_task_count_is_refused_with_both_ways_out():
    with pytest.raises(ValueError, match=r"srun started 3 tasks on 2 nodes for 4 ranks: "
                                         r"use one task per rank \(--ntasks 4\) or one per node"):
        slurm_launch(4, None, None, env={**SLURM, "SLURM_NTASKS": "3"})
    assert slurm_launch(4, None, None, env={}) is None


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"nnodes": 1, "node_rank": None, "master_addr": None, "master_port": None, **kw})


def test_nnodes_flags(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    launch = choose_launch(_args(nnodes=2, node_rank=1, master_addr="node0"), 4)
    assert launch == NodeLaunch(4, 2, 1, "tcp://node0:29500") and launch.first_rank == 2
    with pytest.raises(SystemExit, match="--nnodes > 1 needs --node-rank and --master-addr"):
        choose_launch(_args(nnodes=2), 4)
    with pytest.raises(SystemExit, match=r"3 ranks \(--tensor-parallel-size x --pipeline-parallel-size\) are not a "
                                         r"multiple of --nnodes 2"):
        choose_launch(_args(nnodes=2, node_rank=0, master_addr="node0"), 3)
    with pytest.raises(SystemExit, match=r"--node-rank 2 must be in \[0, 2\)"):
        choose_launch(_args(nnodes=2, node_rank=2, master_addr="node0"), 4)
    single = choose_launch(_args(), 2)
    assert (single.nnodes, single.node_rank, single.init_method.startswith("tcp://127.0.0.1:")) == (1, 0, True)


def test_serve_under_srun_with_a_task_per_rank_matches_one_rank(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompt = "w8 w9 w10"
    with LLM(model_dir, kv_cache_memory_gb=0.05) as llm:
        expected = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].text
    port = str(find_free_port())
    args = [model_dir, "-tp", "2", "--device", "cpu", "--served-model-name", "tiny", "--kv-cache-memory", "0.05"]
    slurm = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "1"}
    ranks = TwoRanks([*args, "--master-port", port], *({**slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}
                                                        for r in (0, 1)), torchrun_env=False)
    try:
        ranks.wait_healthy()
        client = openai.OpenAI(base_url=f"{ranks.url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
    finally:
        ranks.stop()
    assert got == expected


def test_control_interface_sets_gloo_socket_ifname_for_every_rank(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "shardserve", "serve", tiny_model_dir("qwen2"), "-tp", "2", "--device", "cpu",
         "--control-interface", "no-such-iface0", "--kv-cache-memory", "0.05", "--port",
         str(find_free_port())],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode != 0
    assert "no-such-iface0" in result.stdout + result.stderr, "gloo was told to use the named interface"


def test_a_script_without_a_main_guard_stops_at_once_naming_the_fix(tiny_model_dir, tmp_path):
    """Each spawned rank imports the script again; unguarded, it dies trying to start ranks of its own, and rank 0
    stops waiting for it then (not at the 120 s rendezvous timeout), saying what to change."""
    script = tmp_path / "unguarded.py"
    script.write_text("from shardserve.entrypoints.llm import LLM\n"
                      f"LLM({tiny_model_dir('qwen2')!r}, tensor_parallel_size=2, device='cpu', kv_cache_memory_gb=0.05)\n"
                      "print('started')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                            env={**os.environ, "SHARDSERVE_COLLECTIVE_TIMEOUT_S": "90"}, cwd=tmp_path)
    assert result.returncode != 0 and "started" not in result.stdout
    assert "rank1" in result.stderr and "before it connected to rank 0" in result.stderr
    assert 'if __name__ == "__main__":' in result.stderr
