"""A server whose rank fails mid-stream, seen from outside: the tests of the mp and Ray backends share these."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import openai

PROMPT = "w3 w1 w4 w1 w5"


def greedy(client: openai.OpenAI, max_tokens: int = 12) -> str:
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def wait_for_health(proc: subprocess.Popen, url: str, status: int, timeout: float) -> float:
    """Seconds until /health answers `status`; fails after `timeout`."""
    started = time.monotonic()
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == status:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        assert time.monotonic() - started < timeout, f"/health did not answer {status} within {timeout} s"
        time.sleep(0.1)


def stream_in_background(client: openai.OpenAI, on_chunk) -> dict:
    """Consume a long greedy stream on a thread; the dict gets 'chunks', then 'error' and 'ended_at'."""
    state: dict = {"chunks": 0}

    def consume():
        try:
            for _ in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=480, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                state["chunks"] += 1
                on_chunk(state["chunks"])
        except openai.APIError as e:
            state["error"] = e
        state["ended_at"] = time.monotonic()

    state["thread"] = threading.Thread(target=consume, daemon=True)
    state["thread"].start()
    return state


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=90)
