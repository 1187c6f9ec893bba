"""A deadline for each collective start-up step, so a rank whose peers never join a step stops with a message
naming itself and the step, instead of waiting forever.

Start-up collectives that wait inside native code (a symmetric-memory rendezvous, a CUDA-graph capture of
collectives, a peer-memory exchange) cannot be interrupted from Python: when a step outlives its deadline
the watchdog logs which rank waited in which step, dumps every thread's stack to stderr and ends the
process with EXIT_CODE, which the launcher and supervisor report like any dead rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
from typing import Iterator

from shardserve import envs

logger = logging.getLogger(__name__)

TIMEOUT_ENV = envs.SETUP_TIMEOUT_S.name
EXIT_CODE = 75


def timeout_s() -> float:
    return envs.SETUP_TIMEOUT_S.get()


@contextlib.contextmanager
def setup_step(step: str, rank: int, seconds: float | None = None) -> Iterator[None]:
    """Run the body as start-up step `step` of `rank`; end the process if it takes longer than `seconds`
    ($SHARDSERVE_SETUP_TIMEOUT_S, default 300)."""
    limit = timeout_s() if seconds is None else seconds
    done = threading.Event()

    def watch() -> None:
        if done.wait(limit):
            return
        message = (f"rank {rank}: start-up step '{step}' did not finish within {limit:.0f} s ({TIMEOUT_ENV}); "
                   f"every rank must take part in it: look for a rank that died, waits in another step, or "
                   f"runs different code. Stopping this rank.")
        logger.error(message)
        print(f"shardserve: {message}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(EXIT_CODE)

    threading.Thread(target=watch, name=f"shardserve-setup-{step}", daemon=True).start()
    try:
        yield
    finally:
        done.set()
