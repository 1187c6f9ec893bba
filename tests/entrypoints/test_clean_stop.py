"""Ctrl-C on a `serve -tp 2` server is a clean stop: the stream in flight ends at once with a 503 that says
the server is shutting down, the process exits 0, and the log has no ERROR line and no traceback (before:
"engine loop failed; failing all requests" and gloo's "Connection closed by peer")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx

from shardserve.distributed.process_group import find_free_port
from tests.serving import stream_in_background, wait_until, wait_until_healthy


def _requests_held(url: str) -> float:
    """The server's own count of the requests it holds, running or waiting (its /metrics gauges)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("shardserve:num_requests_running", "shardserve:num_requests_waiting")))


def test_ctrl_c_stops_a_two_rank_server_quietly_and_tells_streams_why(tiny_model_dir):
    port = find_free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve", "serve", tiny_model_dir("llama-untied"), "-tp", "2", "--device", "cpu",
         "--served-model-name", "tiny", "--kv-cache-memory", "0.05", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, [proc], 120, lambda: proc.stdout.read())
        reader, events, started = stream_in_background(
            url, {"model": "tiny", "prompt": "w1 w2", "max_tokens": 480, "ignore_eos": True})
        statuses: list[int] = []

        def whole() -> None:
            body = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 480, "ignore_eos": True}
            statuses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code)

        waiter = threading.Thread(target=whole, daemon=True)
        waiter.start()
        assert started.wait(60), "the stream never started"
        # Ctrl-C must find both requests inside the server, not the second one still on its way in.
        assert wait_until(lambda: _requests_held(url) >= 2, 60), "the second request never reached the server"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group gets it
        code = proc.wait(timeout=60)
        reader.join(timeout=30)
        waiter.join(timeout=30)
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, output
    assert "Traceback" not in output and " ERROR " not in output, output
    errors = [e for e in events if '"error"' in e]
    assert errors and "The server is shutting down" in errors[0], events[-3:]
    assert statuses == [503], "a request in flight that was not streamed gets a 503"


def test_an_api_server_stops_in_order_when_ctrl_c_comes_after_the_cores_sigterm():
    """Ctrl-C reaches the API server processes too, but the engine core stops them with SIGTERM; a SIGINT that
    arrives after that SIGTERM must not count as a second Ctrl-C (which makes uvicorn skip its orderly
    shutdown and log a traceback)."""
    from fastapi import FastAPI
    import uvicorn

    from shardserve.entrypoints.openai.server import _Server

    api_server = _Server(uvicorn.Config(FastAPI()), on_signal=None, ignore_interrupt=True)
    api_server.handle_exit(signal.SIGTERM, None)
    api_server.handle_exit(signal.SIGINT, None)
    assert api_server.should_exit and not api_server.force_exit
    single_process = _Server(uvicorn.Config(FastAPI()), on_signal=None)
    single_process.handle_exit(signal.SIGTERM, None)
    single_process.handle_exit(signal.SIGINT, None)
    assert single_process.force_exit, "without it, a second stop signal is uvicorn's forced exit"
