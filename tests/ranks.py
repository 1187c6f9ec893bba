"""Running a function as each rank of a small process group, in spawned processes (CPU, gloo)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Callable

from shardserve.distributed.process_group import find_free_port


def run_ranks(target: Callable, world_size: int, *args, timeout: float = 120) -> dict[int, str]:
    """Start target(rank, port, *args, results) for every rank; returns {rank: what it put in results}.

    `target` must be a module-level function; each rank puts one (rank, outcome) pair into `results`.
    """
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    port = find_free_port()
    procs = [spawn.Process(target=target, args=(rank, port, *args, results)) for rank in range(world_size)]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(30)
    return outcome
