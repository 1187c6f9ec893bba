"""Running real shardserve servers inside tests: in-process (engine inspectable) or as the CLI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import openai
import uvicorn
from fastapi import FastAPI

from shardserve.distributed.process_group import find_free_port

if TYPE_CHECKING:
    from shardserve.engine.async_engine import AsyncEngine


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn on a free 127.0.0.1 port in a background thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_until(condition, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


@dataclass
class InProcessServer:
    url: str
    model: str
    engine: AsyncEngine
    api_key: str | None = None

    @property
    def blocks(self):
        return self.engine.engine.block_manager

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=60, **kwargs)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def all_blocks_free(self, timeout: float = 10.0) -> bool:
        """Wait for the engine to go idle; True when every KV block is then back in the free pool."""
        inner = self.engine.engine
        return wait_until(lambda: not inner.has_work() and self.blocks.num_free_blocks == self.blocks.num_blocks,
                          timeout)


@contextmanager
def serve_model(model_dir: str, tp: int = 1, name: str = "tiny", api_key: str | None = None,
                max_body_bytes: int | None = None, chat_parsers=None, **engine_options) -> Iterator[InProcessServer]:
    """A real engine (rank 0 in this process, other ranks spawned) behind the real HTTP app.

    `api_key`, `max_body_bytes` and `chat_parsers` go to `build_app` (None: its defaults); the rest to
    `EngineConfig`.
    """
    from shardserve.config import EngineConfig
    from shardserve.distributed.launcher import LocalRanks
    from shardserve.engine.async_engine import AsyncEngine
    from shardserve.engine.llm_engine import LLMEngine, run_worker
    from shardserve.entrypoints.openai.server import build_app
    from shardserve.tokenizer import Tokenizer

    engine_options.setdefault("kv_cache_memory_gb", 0.05)
    config = EngineConfig(model=model_dir, tensor_parallel_size=tp, **engine_options)
    ranks = LocalRanks(config, worker=run_worker)
    try:
        tokenizer = Tokenizer.from_model_path(model_dir)
        engine = AsyncEngine(lambda: LLMEngine(config, ranks.ctx, tokenizer))
        try:
            app_options = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
            if chat_parsers is not None:
                app_options["chat_parsers"] = chat_parsers
            with serve_in_thread(build_app(engine, name, api_key=api_key, **app_options)) as url:
                yield InProcessServer(url, name, engine, api_key)
        finally:
            engine.shutdown()
    finally:
        ranks.close()


def stop_processes(procs: list[subprocess.Popen], sig: int, timeout: float) -> None:
    """Send each of `procs` `sig`, then give them `timeout` seconds each before killing them."""
    for p in procs:
        p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_until_healthy(url: str, procs: list[subprocess.Popen], timeout: float, log: Callable[[], str]) -> None:
    """Return once GET url/health answers 200. Fails with `log()` (the processes' output) as soon as one of
    `procs` exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        exited = next((p for p in procs if p.poll() is not None), None)
        if exited is not None:
            raise AssertionError(f"{' '.join(map(str, exited.args[:4]))} exited with {exited.returncode}:\n{log()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not become healthy within {timeout} s")
        time.sleep(0.3)


@contextmanager
def serve_cli(args: list[str], timeout: float = 180.0, launcher: list[str] | None = None,
              env: dict[str, str] | None = None) -> Iterator[str]:
    """`python -m shardserve serve ARGS --port P` as a subprocess (or `LAUNCHER -m shardserve ...`, e.g.
    torchrun); yields the base URL once /health answers 200.

    Its output is read all along (and the last lines kept for errors): a server whose log pipe filled up
    would block in its next log line, access logs included, and stop answering.
    """
    port = find_free_port()
    prefix = launcher if launcher is not None else [sys.executable]
    proc = subprocess.Popen([*prefix, "-m", "shardserve", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    output: deque[str] = deque(maxlen=2000)
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"

    def log() -> str:
        reader.join(timeout=10)  # the process has exited: its last lines are on their way
        return "".join(output)

    try:
        wait_until_healthy(url, [proc], timeout, log)
        yield url
    finally:
        stop_processes([proc], signal.SIGTERM, 30)


def stream_in_background(url: str, body: dict) -> tuple[threading.Thread, list[str], threading.Event]:
    """POST a streamed completion on a thread: its `data:` payloads are appended to the list as they come, and
    the event is set at the first."""
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, events, started
