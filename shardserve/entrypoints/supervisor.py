"""Keeps the ranks serving: watches them, fails in-flight requests the moment one dies, restarts them all.

The supervisor is an EngineClient (requests/client.py) like the AsyncEngine it wraps, so the HTTP server stays
up through a restart and answers /health with 503 and the reason meanwhile.
Failures: a rank process that exits, an engine error, or an engine loop stuck for STALL_RESTART_S (a
hung rank; SHARDSERVE_STALL_RESTART_S sets other seconds). Invariants: requests are only ever given to the
current engine; a failure is acted on once (in-flight requests end with an error, the old ranks are torn down,
new ones start after a back-off of 1, 2, 4 ... up to 30 s); after `max_restarts` restarts it gives up
(`gave_up` says why) and the server exits non-zero, so that systemd, Kubernetes or Slurm see the failure.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from typing import AsyncIterator, Callable

from shardserve import envs
from shardserve.distributed.launcher import Ranks
from shardserve.engine.async_engine import AsyncEngine
from shardserve.requests.client import EngineStats
from shardserve.requests.commands import EngineCall
from shardserve.requests.outputs import RequestOutput
from shardserve.requests.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 0.5
MAX_BACKOFF_S = 30.0
# A step stuck this long counts as a hung rank (/health already fails after HEALTH_STALL_S). Generous,
# because one long prefill chunk of a large model on a CPU can take many seconds.
STALL_RESTART_S = envs.STALL_RESTART_S.default
STALL_RESTART_ENV = envs.STALL_RESTART_S.name


def stall_restart_seconds() -> float:
    """How long the engine loop may make no progress before its ranks count as hung and restart:
    SHARDSERVE_STALL_RESTART_S where set (seconds, a positive number; a ValueError naming it otherwise), else
    STALL_RESTART_S."""
    return envs.STALL_RESTART_S.get()


class Supervisor:
    def __init__(self, start: Callable[[], tuple[AsyncEngine, Ranks]], max_restarts: int) -> None:
        self._start = start
        self.max_restarts = max_restarts
        self.stall_restart_s = stall_restart_seconds()
        self.engine, self.ranks = start()
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.restarts = 0
        self.last_failure: str | None = None
        self.gave_up: str | None = None  # set once the restarts are used up: the process should exit
        self._restarting = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardserve-supervisor", daemon=True)
        self._thread.start()

    # -- what the HTTP app calls -----------------------------------------------------------------
    def is_healthy(self) -> bool:
        return not self._restarting and self.engine.is_healthy()

    def health_details(self) -> dict:
        current = None if self._restarting else self._problem()  # seen before the watch acts on it
        return {"restarts": self.restarts, "last_failure": current or self.last_failure}

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats(), restarts=self.restarts)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(request_id, prompt_token_ids, params):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    # -- what the engine core server calls (ipc/core_server.py) ----------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream) -> None:
        self.engine.submit(request_id, prompt_token_ids, params, stream)

    def abort_soon(self, request_id: str) -> None:
        self.engine.abort_soon(request_id)

    def call(self, command: EngineCall) -> concurrent.futures.Future:
        return self.engine.call(command)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def sleep(self, level: int) -> None:
        await self.engine.sleep(level)

    async def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        await self.engine.wake_up(weights, kv_cache)

    def stop_accepting(self, reason: str) -> None:
        self.engine.stop_accepting(reason)

    def shutdown(self) -> None:
        """A clean stop: the engine sends the other ranks a shutdown plan and they leave in order (a failed
        engine's ranks are torn down workers first instead, see _teardown)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._restarting or self.gave_up is not None or self._problem() is not None:
            self._teardown()
            return
        self.engine.shutdown(timeout=30)
        self.ranks.close(timeout=10)

    # -- the watch --------------------------------------------------------------------------------
    def _problem(self) -> str | None:
        dead = self.ranks.dead_rank()
        if dead is not None:
            return dead
        error = self.engine.error
        if error is not None:
            return f"the engine failed: {error}"
        stalled = self.engine.stalled_for()
        if stalled > self.stall_restart_s:
            return f"the engine made no progress for {stalled:.0f} s (a rank hung?)"
        return None

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            problem = self._problem()
            if problem is None:
                continue
            self.last_failure = problem
            self.engine.fail(problem)
            if self.restarts >= self.max_restarts:
                logger.error("%s; in-flight requests failed; not restarting (--max-restarts %d reached)", problem,
                             self.max_restarts)
                self.gave_up = f"{problem} (--max-restarts {self.max_restarts} used up)"
                return
            self._restarting = True
            delay = min(MAX_BACKOFF_S, 2.0 ** self.restarts)
            logger.error("%s; in-flight requests failed; restarting all ranks in %.0f s (restart %d of %d)",
                         problem, delay, self.restarts + 1, self.max_restarts)
            self._teardown()
            if self._stop.wait(delay):
                return
            self.restarts += 1
            try:
                self.engine, self.ranks = self._start()
            except Exception as e:  # noqa: BLE001 - counted as a failed restart; the watch goes on
                self.last_failure = f"restart {self.restarts} failed: {e}"
                logger.exception("restart %d failed", self.restarts)
                continue
            self._restarting = False
            logger.info("all %d ranks restarted (restart %d of %d); serving again", self.ranks.ctx.world_size,
                        self.restarts, self.max_restarts)

    def _teardown(self) -> None:
        # Workers go first: an engine thread blocked in a collective with a hung rank is released when
        # that rank's connections close, and then its loop can stop.
        self.ranks.stop_workers()
        self.engine.shutdown(timeout=10)
        self.ranks.close(timeout=5)
