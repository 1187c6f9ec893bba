"""The models of a pool: one `shardserve serve` process each, kept awake within the memory budget.

Invariants (all changes happen under one asyncio condition):
- the awake models' memory_gb sum to at most the budget;
- a model with requests in flight is never put to sleep; a request for a sleeping model waits until
  enough idle models (least recently used first) have been put to sleep, then wakes it;
- every request holds its model (in_flight) from before it is forwarded until its response has ended.

The pool is its models' only client. Each model's server binds 127.0.0.1 and requires the pool's member
key, a random one made per launch, which `Pool.client` sends on every request: without it, anything
else on the machine that can reach a loopback port could skip the pool's own API key, or sleep and wake
a model behind the pool's back, leaving its record of which models are awake wrong. The servers read
the key from SHARDSERVE_API_KEY, so it is not on their command lines (which any user can list); only
their own user (and root) can read their environment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
import time

import httpx

from shardserve.distributed.process_group import find_free_port
from shardserve.entrypoints.openai.middleware import API_KEY_ENV
from shardserve.pool.config import PoolConfig, PoolModel

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0


class ServerProcess:
    """A `shardserve serve` child process on a free loopback port that takes only the member key (read from its
    environment): started, watched, waited for, stopped. Subclasses say its command line."""

    def __init__(self, name: str, member_key: str) -> None:
        self.name = name
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.member_key = member_key
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env[API_KEY_ENV] = self.member_key  # in the environment, not on the command line that `ps` shows
        return env

    def start(self) -> None:
        self.process = subprocess.Popen(self.command(), env=self.environment())

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        """Until its /health answers 200; RuntimeError if it exits first or takes over READY_TIMEOUT_S."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} while starting")
            try:
                if (await client.get(f"{self.url}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.name} did not start within {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Backend(ServerProcess):
    """A model of the pool: its server, and whether it is awake."""

    def __init__(self, spec: PoolModel, device: str | None, member_key: str) -> None:
        super().__init__(spec.name, member_key)
        self.spec = spec
        self.device = device
        self.awake = False
        self.in_flight = 0
        self.last_used = time.monotonic()
        self.swaps = 0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "shardserve", "serve", self.spec.model, "-tp", str(self.spec.tensor_parallel_size),
               "--port", str(self.port), "--served-model-name", self.spec.name, *self.spec.args]
        return cmd + (["--device", self.device] if self.device else [])

    def environment(self) -> dict[str, str]:
        env = super().environment()
        if self.spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.spec.gpus))
        return env

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        try:
            await super().wait_ready(client)
        except RuntimeError as e:
            raise RuntimeError(f"model {e}") from None
        self.awake = True

    async def sleep(self, client: httpx.AsyncClient) -> None:
        started = time.monotonic()
        (await client.post(f"{self.url}/sleep", params={"level": "1"}, timeout=None)).raise_for_status()
        self.awake = False
        logger.info("model %s asleep in %.2f s", self.name, time.monotonic() - started)

    async def wake(self, client: httpx.AsyncClient) -> None:
        started = time.monotonic()
        (await client.post(f"{self.url}/wake_up", timeout=None)).raise_for_status()
        self.awake = True
        self.swaps += 1
        logger.info("model %s awake in %.2f s", self.name, time.monotonic() - started)


class Pool:
    def __init__(self, config: PoolConfig, device: str | None = None) -> None:
        self.config = config
        member_key = secrets.token_urlsafe(32)  # unrelated to config.api_key, which clients hold
        self.backends = {m.name: Backend(m, device, member_key) for m in config.models}
        self.client = httpx.AsyncClient(timeout=None, headers={"Authorization": f"Bearer {member_key}"})
        self._cond = asyncio.Condition()

    def _awake_gb(self, extra: Backend | None = None) -> float:
        return sum(b.spec.memory_gb for b in self.backends.values() if b.awake or b is extra)

    def _fits(self, backend: Backend) -> bool:
        budget = self.config.memory_budget_gb
        return budget is None or self._awake_gb(extra=backend) <= budget + 1e-9

    async def start(self) -> None:
        """Start the models one at a time (each loads awake), putting earlier ones to sleep to stay in budget."""
        for backend in self.backends.values():
            async with self._cond:
                await self._make_room(backend)
            backend.start()
            await backend.wait_ready(self.client)
            logger.info("model %s ready (%s)", backend.name, backend.spec.model)

    async def _make_room(self, backend: Backend) -> bool:
        """Sleep idle awake models, least recently used first, until `backend` fits. Caller holds the lock."""
        idle = sorted((b for b in self.backends.values() if b.awake and b is not backend and b.in_flight == 0),
                      key=lambda b: b.last_used)
        while not self._fits(backend) and idle:
            await idle.pop(0).sleep(self.client)
        return self._fits(backend)

    async def acquire(self, name: str) -> Backend:
        backend = self.backends[name]
        async with self._cond:
            while not backend.awake:
                if await self._make_room(backend):
                    await backend.wake(self.client)
                    break
                await self._cond.wait()  # models in flight hold the memory: wait for one to finish
            backend.in_flight += 1
            backend.last_used = time.monotonic()
            return backend

    async def release(self, backend: Backend) -> None:
        async with self._cond:
            backend.in_flight -= 1
            backend.last_used = time.monotonic()
            self._cond.notify_all()

    async def expire_idle(self) -> None:
        """Put to sleep the models idle for longer than their ttl_s."""
        now = time.monotonic()
        async with self._cond:
            for b in self.backends.values():
                if b.awake and b.spec.ttl_s is not None and b.in_flight == 0 and now - b.last_used > b.spec.ttl_s:
                    logger.info("model %s idle for %.0f s (ttl_s %g): putting it to sleep", b.name,
                                now - b.last_used, b.spec.ttl_s)
                    await b.sleep(self.client)
            self._cond.notify_all()

    async def close(self) -> None:
        for b in self.backends.values():
            b.stop()
        await self.client.aclose()
