"""A `shardserve pool` started as the command line starts it, for the tests of tests/pool."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import yaml

from shardserve.distributed.process_group import find_free_port
from tests.serving import stop_processes, wait_until_healthy

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
            wait_until_healthy(url, [pool], START_TIMEOUT_S, lambda: (log.seek(0), log.read())[1])
            yield RunningPool(url, pool)
        finally:
            stop_processes([pool], signal.SIGINT, 60)
