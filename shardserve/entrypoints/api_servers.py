"""The HTTP front ends, each in its own process (`--api-server-count N`): HTTP, validation, chat templates,
tokenization, detokenization, stop strings and SSE, with the engine core (rank 0's process) behind
ipc/core_server.py.

Rank 0's process spawns them before it loads the model (so their tokenizers load meanwhile), on the HTTP
socket it has already bound: the kernel hands each new connection to one of them. A front end listens only
once the engine core has answered (clients get "connection refused" until then, as from one process), stops
when rank 0's process is gone, and is started again if it dies (its requests are aborted in the engine).
Request metrics of all front ends are counted in one place (prometheus_client's multiprocess files), so
/metrics shows the same totals whichever of them answers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any
from typing import Callable

from shardserve.process_name import name_this_process

logger = logging.getLogger(__name__)

_METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_RESTART_DELAY_S = 1.0
MAX_RESTARTS = 10  # API servers that died and were started again, in all; then the server exits non-zero


@dataclass(frozen=True)
class FrontendOptions:
    tokenizer_path: str
    served_model_name: str
    api_key: str | None
    max_body_bytes: int
    host: str
    port: int
    ipc_dir: str
    metrics_dir: str
    log_level: int
    chat_parsers: Any = None  # chat_output.ChatParsers (None: the defaults)


class ApiServers:
    """The front-end processes of one server: started, watched, restarted, stopped."""

    def __init__(self, count: int, sock: socket.socket, options: FrontendOptions) -> None:
        self.count = count
        self.sock = sock
        self.options = options
        self.restarts = 0
        self._spawn = mp.get_context("spawn")
        self._processes: list = [None] * count

    @staticmethod
    def make_dirs() -> tuple[str, str]:
        """A private directory for the channel's sockets and one for the metrics files."""
        ipc_dir = tempfile.mkdtemp(prefix="shardserve-ipc-")
        return ipc_dir, tempfile.mkdtemp(prefix="shardserve-metrics-")

    def start(self) -> None:
        for i in range(self.count):
            self._start_one(i)

    def _start_one(self, index: int) -> None:
        p = self._spawn.Process(target=frontend_main, args=(self.options, index, self.sock, os.getpid()),
                                name=f"shardserve-api{index}", daemon=True)
        p.start()
        self._processes[index] = p

    def restart_dead(self, on_lost: Callable[[int], None]) -> str | None:
        """Start again each front end that has exited, after `on_lost(index)` (its requests are gone); the
        reason to give up once they have died MAX_RESTARTS times."""
        for i, p in enumerate(self._processes):
            if p is None or p.is_alive():
                continue
            on_lost(i)
            if self.restarts >= MAX_RESTARTS:
                return f"API server {i} exited with code {p.exitcode}, after {self.restarts} restarts of API servers"
            logger.error("API server %d (pid %d) exited with code %s; starting it again", i, p.pid, p.exitcode)
            time.sleep(_RESTART_DELAY_S)
            self.restarts += 1
            self._start_one(i)
        return None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM each (it ends its requests in flight with a 503 and finishes sending them), then wait."""
        for p in self._processes:
            if p is not None and p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self._processes:
            if p is None:
                continue
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                logger.warning("API server %s did not stop within %.0f s; killing it", p.name, timeout)
                p.kill()
                p.join(5)

    def cleanup(self) -> None:
        shutil.rmtree(self.options.ipc_dir, ignore_errors=True)
        shutil.rmtree(self.options.metrics_dir, ignore_errors=True)


def frontend_main(options: FrontendOptions, index: int, sock: socket.socket, parent_pid: int) -> None:
    """A front end's process: the OpenAI app over a CoreClient, until SIGTERM (rank 0's process sends it; a
    Ctrl-C is rank 0's to act on) or until rank 0's process is gone."""
    # Before prometheus_client is imported: request metrics go to files every front end's /metrics reads.
    os.environ[_METRICS_DIR_ENV] = options.metrics_dir
    name_this_process(f"shardserve-api{index}")
    logging.basicConfig(level=options.log_level,
                        format=f"%(asctime)s api{index} %(levelname)s %(name)s: %(message)s")
    from shardserve.entrypoints.openai.server import build_app, serve_http
    from shardserve.ipc.core_client import CoreClient
    from shardserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(options.tokenizer_path)
    client = CoreClient(options.ipc_dir, index, tokenizer)

    def parent_gone() -> str | None:
        return "rank 0's process exited" if os.getppid() != parent_pid else None

    async def startup() -> None:
        await client.start(is_abandoned=parent_gone)

    app = build_app(client, options.served_model_name, api_key=options.api_key,
                    max_body_bytes=options.max_body_bytes, on_startup=startup, on_shutdown=client.stop,
                    **({"chat_parsers": options.chat_parsers} if options.chat_parsers is not None else {}))
    reason = serve_http(app, options.host, options.port, sock, stop_when=parent_gone, ignore_interrupt=True)
    if reason is not None:
        logger.error("API server %d stops: %s", index, reason)
