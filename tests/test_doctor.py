"""`shardserve doctor`: host checks, the ranks' handshake and an all-reduce smoke test, with exit
status 0 (ready), 1 (blocked) or 3 (warnings only)."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys

from shardserve.cli import main
from shardserve.distributed.process_group import find_free_port
from shardserve.entrypoints import doctor


def test_doctor_on_two_local_cpu_ranks_prints_the_smoke_test_and_exits_0():
    result = subprocess.run([sys.executable, "-m", "shardserve", "doctor", "-tp", "2", "--device", "cpu"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ranks run the same code, config and environment" in result.stdout
    match = re.search(r"2 ranks over gloo: 4 KiB in ([\d.]+) us .* 64 MiB at ([\d.]+) GB/s", result.stdout)
    assert match and float(match[1]) > 0 and float(match[2]) > 0, result.stdout
    assert result.stdout.strip().endswith("doctor: ready to serve")


def test_doctor_across_ranks_that_differ_fails_naming_the_variable():
    port = str(find_free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "SHARDSERVE_", "SLURM_"))}
    base["SHARDSERVE_CONTROL_TOKEN"] = "test-control-token"
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "LOCAL_RANK": "0",
              "LOCAL_WORLD_SIZE": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "shardserve", "doctor", "-tp", "2", "--device", "cpu"],
                              env={**base, **launch, "RANK": str(rank), **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank, extra in ((0, {}), (1, {"NCCL_PROTO": "Simple"}))]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outputs
    for out in outputs:
        assert "[   FAIL] handshake:" in out and "NCCL_PROTO differs:" in out and "has 'Simple'" in out
        assert "doctor: cannot serve" in out


def test_rdma_without_unlimited_locked_memory_is_a_warning_with_the_fix(monkeypatch):
    monkeypatch.setattr(doctor.os.path, "isdir", lambda p: p == "/dev/infiniband")
    monkeypatch.setattr(doctor.os, "listdir", lambda p: ["rdma_cm", "uverbs0"])
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda which: (65536, resource.RLIM_INFINITY))
    (finding,) = doctor._rdma_findings()
    assert finding.level == doctor.WARN
    assert "rdma_cm, uverbs0" in finding.message and "64 KiB" in finding.message
    assert "ulimit -l unlimited" in finding.message


def test_warnings_only_exit_3(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "_rdma_findings", lambda: [doctor.Finding(doctor.WARN, "RDMA", "memlock 64 KiB")])
    assert main(["doctor", "--device", "cpu"]) == 3
    assert capsys.readouterr().out.strip().endswith("doctor: can serve, with warnings above")


def test_doctor_refuses_cuda_without_a_gpu(capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["doctor", "--device", "cuda"]) == 1
    assert "--device cuda but torch sees no CUDA GPU" in capsys.readouterr().out
