"""Starting the ranks: local worker processes for `-tp N`, or joining a torchrun group."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass

import torch

from shardserve.config import EngineConfig
from shardserve.distributed.process_group import RankContext, find_free_port, init_rank_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    init_method: str | None  # None: read MASTER_ADDR/PORT from the environment (torchrun)
    local_rank: int
    local_world_size: int


def torchrun_launch_info() -> LaunchInfo | None:
    """Rank facts when started under torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return LaunchInfo(int(os.environ["RANK"]), world, "env://", int(os.environ.get("LOCAL_RANK", 0)),
                      int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def set_cpu_threads(local_world_size: int) -> None:
    # Ranks on one machine share its cores; oversubscribing them slows every rank down.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def _worker_main(config: EngineConfig, info: LaunchInfo, log_level: int) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{info.rank} %(levelname)s %(name)s: %(message)s")
    from shardserve.engine.llm_engine import run_worker

    from shardserve.distributed.handshake import StartupMismatch

    set_cpu_threads(info.local_world_size)
    try:
        ctx = init_rank_context(info.rank, info.world_size, config.device, info.init_method, info.local_rank,
                                config)
    except StartupMismatch:
        sys.exit(1)  # rank 0 reports the mismatch

    try:
        run_worker(config, ctx)
    finally:
        from shardserve.distributed.process_group import destroy_rank_context

        destroy_rank_context(ctx)


class LocalRanks:
    """Rank 0 in this process plus world_size - 1 spawned worker processes on this machine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        n = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{find_free_port()}"
        spawn = mp.get_context("spawn")
        self.processes = []
        for rank in range(1, n):
            info = LaunchInfo(rank, n, init_method, rank, n)
            p = spawn.Process(target=_worker_main, args=(config, info, logging.getLogger().level),
                              name=f"shardserve-rank{rank}", daemon=True)
            p.start()
            self.processes.append(p)
        set_cpu_threads(n)
        self.ctx: RankContext = init_rank_context(0, n, config.device, init_method, 0, config)

    def close(self, timeout: float = 30.0) -> None:
        """Leave the process group, then wait for the other ranks to exit.

        Ranks leave together: NCCL's teardown waits for every rank of the communicator, so rank 0 must
        not wait for the workers to exit before it leaves too (that deadlocks until the timeout).
        """
        from shardserve.distributed.process_group import destroy_rank_context

        destroy_rank_context(self.ctx)
        self.join(timeout)

    def join(self, timeout: float = 30.0) -> None:
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                logger.warning("rank process %s did not exit; terminating it", p.name)
                p.terminate()
