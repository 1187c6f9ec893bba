"""`serve --api-server-count N`: the HTTP front ends in their own processes, the engine core in rank 0's.

What a user sees must not change across the boundary: the same text as the offline engine (stop strings are
matched in the front end now), one /metrics and one sleep state whichever front end answers, blocks freed
for requests whose front end died, and no front end left behind when rank 0's process is killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from contextlib import contextmanager

import httpx
import openai

from shardserve.distributed.process_group import find_free_port
from tests.serving import wait_until, wait_until_healthy

PROMPTS = ["w5 w9", "w7 w8", "w30 w31 w32 w33"]


@contextmanager
def api_server_processes(model: str, count: int, *flags: str):
    """`shardserve serve MODEL --api-server-count COUNT [FLAGS]` in its own session; yields (url, process, its
    log)."""
    port = find_free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve", "serve", model, "--device", "cpu", "--served-model-name", "tiny",
         "--kv-cache-memory", "0.05", "--api-server-count", str(count), "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output: deque[str] = deque(maxlen=3000)
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, [proc], 120, lambda: "".join(output))
        yield url, proc, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def api_server_pids(parent: int) -> list[int]:
    """The API server processes of a server (named shardserve-api0, -api1, ...)."""
    children = open(f"/proc/{parent}/task/{parent}/children").read().split()
    return [int(c) for c in children if open(f"/proc/{c}/comm").read().startswith("shardserve-api")]


def metric(url: str, name: str) -> float:
    """One value of /metrics, read over a new connection (so any front end may answer)."""
    text = httpx.get(f"{url}/metrics", headers={"Connection": "close"}, timeout=10).text
    return sum(float(v) for v in re.findall(rf"^shardserve:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_two_api_servers_give_the_offline_text_and_one_view_of_the_engine(tiny_model_dir):
    from shardserve import LLM, SamplingParams

    model = tiny_model_dir("llama-untied")
    with LLM(model, device="cpu", kv_cache_memory_gb=0.05) as llm:
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
        # A stop string the text really meets: the fourth word of each greedy completion.
        stops = [out.text.split()[3] for out in plain]
        expected = [llm.generate([p], SamplingParams(max_tokens=12, temperature=0, stop=(s,)))[0]
                    for p, s in zip(PROMPTS, stops)]
    assert all(e.finish_reason == "stop" and s not in e.text for e, s in zip(expected, stops))

    with api_server_processes(model, 2) as (url, proc, _):
        assert len(api_server_pids(proc.pid)) == 2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt, stop, want in zip(PROMPTS, stops, expected):
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
            assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")
            assert got.usage.completion_tokens == len(want.token_ids)
            streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                 stop=[stop], stream=True)
            assert "".join(c.choices[0].text for c in streamed) == want.text
        for prompt, want in zip(PROMPTS, plain):
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"

        # Nine requests in all, each counted once, whichever front end served it and whichever answers /metrics.
        counts = {metric(url, "request_success_total") for _ in range(8)}
        assert counts == {9.0}
        # Engine statistics come with the engine's status, every 0.25 s.
        assert wait_until(lambda: metric(url, "kv_cache_blocks_free") == metric(url, "kv_cache_blocks_total"), 5)

        assert httpx.post(f"{url}/sleep").json() == {"is_sleeping": True, "level": 1}
        seen = {httpx.get(f"{url}/is_sleeping", headers={"Connection": "close"}).json()["is_sleeping"]
                for _ in range(8)}
        assert seen == {True}, "every front end sees the sleep at once"
        assert httpx.post(f"{url}/wake_up").json() == {"is_sleeping": False}
        got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert got.choices[0].text == plain[0].text


def test_a_dead_api_server_is_replaced_and_the_engine_drops_its_requests(tiny_model_dir):
    with api_server_processes(tiny_model_dir("llama-untied"), 1) as (url, proc, output):
        total = metric(url, "kv_cache_blocks_total")
        started = threading.Event()

        def stream() -> None:  # cut off when its front end is killed
            body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 480, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                    for _ in response.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(60), "the stream never started"
        assert wait_until(lambda: metric(url, "kv_cache_blocks_free") < total, 5)
        [front_end] = api_server_pids(proc.pid)
        os.kill(front_end, signal.SIGKILL)
        assert wait_until(lambda: "starting it again" in "".join(output), 20), "".join(output)
        wait_until_healthy(url, [proc], 60, lambda: "".join(output))
        assert api_server_pids(proc.pid) != [front_end]
        # The killed front end's request was aborted in the engine: its blocks are back.
        assert wait_until(lambda: metric(url, "kv_cache_blocks_free") == total, 20)
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 4


def test_api_servers_do_not_outlive_the_engine_process(tiny_model_dir):
    with api_server_processes(tiny_model_dir("llama-untied"), 2) as (url, proc, _):
        pids = api_server_pids(proc.pid)
        assert len(pids) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            # A zombie has exited; its parent (now init) reaps it.
            return open(f"/proc/{pid}/stat").read().split()[2] == "Z"

        assert wait_until(lambda: all(gone(p) for p in pids), 15), "an API server outlived the engine's process"


def test_constraints_tools_and_reasoning_cross_to_the_engine_core(byte_model_dir):
    """The grammar runs in the engine core's process, the parsers in the API server's (set by the CLI flags)."""
    import json

    with api_server_processes(byte_model_dir, 1, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                              "--max-model-len", "2048") as (url, _, log):
        assert "tool calls read by the hermes parser, reasoning split out by the qwen3 parser" in "".join(log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        tool = {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"],
            "additionalProperties": False}}}
        got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick."}],
                                             tools=[tool], tool_choice="required", max_tokens=400, seed=1)
        assert got.choices[0].finish_reason == "tool_calls"
        assert json.loads(got.choices[0].message.tool_calls[0].function.arguments)["side"] in ("left", "right")
        got = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Think."}], max_tokens=100, seed=1,
            extra_body={"structured_outputs": {"regex": r"<think>\nHm\.\n</think>\n\n(yes|no)"}})
        message = got.choices[0].message
        assert (message.model_extra["reasoning_content"], message.content in ("yes", "no")) == ("Hm.", True)
