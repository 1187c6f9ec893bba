"""A rank that dies mid-stream: the stream ends with an error (never a hang), /health answers 503
within 10 s, then the supervisor restarts every rank and the server serves the same tokens again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from shardserve.distributed.process_group import find_free_port

PROMPT = "w3 w1 w4 w1 w5"


def _spawned_rank(server_pid: int) -> int:
    """The pid of the rank process the server spawned (not multiprocessing's resource tracker)."""
    for child in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return int(child)
    raise AssertionError("no spawned rank process found")


def _greedy(client: openai.OpenAI, max_tokens: int = 12) -> str:
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_killing_rank_1_mid_stream_fails_the_stream_then_the_server_comes_back(tiny_model_dir):
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs /proc to find the rank process")
    port = find_free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "shardserve", "serve", tiny_model_dir("llama-untied"), "-tp", "2", "--device", "cpu",
         "--served-model-name", "tiny", "--kv-cache-memory", "0.05", "--max-restarts", "2", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        before = _greedy(client)

        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=480, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        received, killed_at = 0, None
        with pytest.raises(openai.APIError):
            for _ in stream:
                received += 1
                if received == 3:
                    os.kill(_spawned_rank(server.pid), signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None and received < 480, "the stream ended with an error, mid-way"

        unhealthy_after = None
        while time.monotonic() - killed_at < 10:
            response = httpx.get(f"{url}/health", timeout=2)
            if response.status_code == 503:
                unhealthy_after = time.monotonic() - killed_at
                assert "rank1" in response.json()["error"]["message"]
                break
            time.sleep(0.1)
        assert unhealthy_after is not None, "/health did not answer 503 within 10 s of the rank's death"

        deadline = time.monotonic() + 90
        while httpx.get(f"{url}/health", timeout=2).status_code != 200:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the supervisor did not bring the server back"
            time.sleep(0.3)
        health = httpx.get(f"{url}/health", timeout=2).json()
        assert health["restarts"] == 1 and "rank1" in health["last_failure"]
        assert _greedy(client) == before, "after the restart the server gives the same tokens"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
