"""A rank that dies mid-stream: the stream ends with an error (never a hang), /health answers 503
within 10 s, then the supervisor restarts every rank and the server serves the same tokens again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shardserve.distributed.process_group import find_free_port
from tests.helpers.rank_faults import greedy, openai_client, stream_in_background, wait_for_health
from tests.serving import stop_processes

def _spawned_rank(server_pid: int) -> int:
    """The pid of the rank process the server spawned (not an API server, nor multiprocessing's resource
    tracker), whichever of its threads spawned it."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():  # after a restart, the supervisor's thread started it
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().strip() == "shardserve-r1":
                return int(child)
    raise AssertionError("no spawned rank process found")



def _start_server(model_dir: str, max_restarts: int) -> tuple[subprocess.Popen, str]:
    """A `shardserve serve -tp 2` process (CPU) and its URL, not yet healthy."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs /proc to find the rank process")
    port = find_free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve", "serve", model_dir, "-tp", "2", "--device", "cpu",
         "--served-model-name", "tiny", "--kv-cache-memory", "0.05", "--max-restarts", str(max_restarts),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A hung rank restarts after 12 s of no progress instead of 30: /health fails after 8 (HEALTH_STALL_S) first.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "SHARDSERVE_STALL_RESTART_S": "12"})
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A `shardserve serve -tp 2` process (CPU, --max-restarts 2) and its URL, once healthy: the faults below
    come one after the other to the same server, each using one of its restarts."""
    proc, url = _start_server(tiny_model_dir("llama-untied"), max_restarts=2)
    try:
        wait_for_health(proc, url, 200, timeout=120)
        yield proc, url
    finally:
        stop_processes([proc], signal.SIGINT, 30)





@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_failed_rank_fails_the_stream_turns_health_503_then_the_server_comes_back(server, fault):
    proc, url = server
    client = openai_client(url)
    before = greedy(client)
    restarts = httpx.get(f"{url}/health", timeout=2).json()["restarts"]
    faulted: dict = {}

    def inject(chunks: int) -> None:
        if chunks == 3:
            os.kill(_spawned_rank(proc.pid), signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            faulted["at"] = time.monotonic()

    stream = stream_in_background(client, inject)
    while "at" not in faulted:
        assert stream["thread"].is_alive(), "the stream ended before the fault"
        time.sleep(0.01)
    assert wait_for_health(proc, url, 503, timeout=10) < 10
    stream["thread"].join(timeout=60)
    assert "error" in stream, "the stream must end with an error, not hang or complete"
    assert stream["chunks"] < 480

    wait_for_health(proc, url, 200, timeout=90)
    health = httpx.get(f"{url}/health", timeout=2).json()
    # A killed rank is named by whichever notices first: the launcher ("rank1 ... exited") or a collective that was
    # waiting for it ("rank 1 (process N) has exited").
    expected = r"rank ?1\b" if fault == "killed" else "made no progress"
    assert health["restarts"] == restarts + 1 and re.search(expected, health["last_failure"]), health
    assert greedy(client) == before, "after the restart the server gives the same tokens"


def test_with_the_restarts_used_up_the_server_fails_the_stream_and_exits_non_zero(tiny_model_dir):
    """--max-restarts 0: the first dead rank ends the stream in flight with an error, then the process exits
    with status 1 (as vLLM does), so that systemd, Kubernetes or Slurm see it, instead of answering 503."""
    proc, url = _start_server(tiny_model_dir("llama-untied"), max_restarts=0)
    try:
        wait_for_health(proc, url, 200, timeout=120)
        killed: dict = {}

        def inject(chunks: int) -> None:
            if chunks == 3:
                os.kill(_spawned_rank(proc.pid), signal.SIGKILL)
                killed["at"] = time.monotonic()

        stream = stream_in_background(openai_client(url), inject)
        stream["thread"].join(timeout=60)
        assert "error" in stream, "the stream in flight must end with an error"
        code = proc.wait(timeout=60)
        output = proc.stdout.read()
        assert code == 1, output
        assert "exiting with status 1" in output and "--max-restarts 0 used up" in output, output
    finally:
        stop_processes([proc], signal.SIGINT, 30)


def test_the_stall_before_a_restart_is_set_in_seconds_and_a_bad_value_is_named(set_env):
    from shardserve.entrypoints.supervisor import STALL_RESTART_S, stall_restart_seconds

    set_env(SHARDSERVE_STALL_RESTART_S=None)
    assert stall_restart_seconds() == STALL_RESTART_S
    set_env(SHARDSERVE_STALL_RESTART_S="12.5")
    assert stall_restart_seconds() == 12.5
    for bad in ("soon", "0", "-3", "inf", "nan"):
        set_env(SHARDSERVE_STALL_RESTART_S=bad)
        with pytest.raises(ValueError, match="SHARDSERVE_STALL_RESTART_S=.*positive number of seconds"):
            stall_restart_seconds()
