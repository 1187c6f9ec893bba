"""A `shardserve pool` started as the command line starts it, for the tests of tests/pool."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import yaml

from shardserve.distributed.process_group import find_free_port

START_TIMEOUT_S = 180


def write_config(tmp_path, config: dict) -> str:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@dataclass(frozen=True)
class RunningPool:
    url: str
    process: subprocess.Popen


@contextlib.contextmanager
def running_pool(config_path: str, *flags: str) -> Iterator[RunningPool]:
    """`shardserve pool CONFIG --device cpu FLAGS...` on a free port, once its /health answers 200 (every
    model started); stopped with SIGINT, as Ctrl-C stops it, when the block ends."""
    port = find_free_port()
    # The log goes to a file, not a pipe: a pipe nobody reads would stall the pool once full.
    with tempfile.TemporaryFile("w+") as log:
        pool = subprocess.Popen([sys.executable, "-m", "shardserve", "pool", config_path, "--port", str(port),
                                 "--device", "cpu", *flags], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(pool, url, log)
            yield RunningPool(url, pool)
        finally:
            pool.send_signal(signal.SIGINT)
            try:
                pool.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pool.kill()


def _wait_healthy(pool: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if pool.poll() is not None:
            log.seek(0)
            raise AssertionError(f"the pool exited with {pool.returncode}:\n{log.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the pool did not start"
        time.sleep(0.3)
