"""Two `shardserve serve -tp 2` processes started as torchrun or two nodes start them, each its own rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from shardserve.distributed.process_group import find_free_port
from tests.serving import stop_processes, wait_until_healthy


class TwoRanks:
    """Rank 0 and rank 1 of `shardserve serve MODEL -tp 2`, each its own process and environment."""

    def __init__(self, args: list[str], env0: dict[str, str], env1: dict[str, str], torchrun_env: bool = True) -> None:
        self.http_port = find_free_port()
        launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "WORLD_SIZE": "2",
                  "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("NCCL_", "SHARDSERVE_", "SLURM_")) and k not in launch and k != "RANK"}
        base["PYTHONUNBUFFERED"] = "1"
        base["SHARDSERVE_CONTROL_TOKEN"] = "test-control-token"  # what every rank of a launch shares
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "shardserve", "serve", *args, "--port", str(self.http_port)],
                             env={**base, **(launch | {"RANK": str(rank)} if torchrun_env else {}), **env},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank, env in ((0, env0), (1, env1))
        ]
        self.url = f"http://127.0.0.1:{self.http_port}"

    def wait_exit(self, timeout: float = 120) -> list[tuple[int, str]]:
        return [(p.wait(timeout=timeout), p.stdout.read()) for p in self.procs]

    def wait_healthy(self, timeout: float = 120) -> None:
        exited = lambda: "\n".join(p.stdout.read() for p in self.procs if p.poll() is not None)  # noqa: E731
        wait_until_healthy(self.url, self.procs, timeout, exited)

    def stop(self) -> None:
        stop_processes(self.procs, signal.SIGTERM, 30)


def serve_args(model_dir: str, *extra: str) -> list[str]:
    return [model_dir, "-tp", "2", "--device", "cpu", "--served-model-name", "tiny", "--kv-cache-memory", "0.05",
            *extra]
