"""Starting the ranks: one process per node that spawns the node's ranks (`-tp N` on one machine, or
`--nnodes M --node-rank R` on each of M machines, or srun with a task per node), or one process per
rank started by torchrun or srun, which joins the group directly."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from shardserve import envs
from shardserve.config import EngineConfig
from shardserve.distributed.control_token import new_token, resolve_token
from shardserve.distributed.process_group import RankContext, RankExitedError, find_free_port, init_rank_context
from shardserve.process_name import name_this_process

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchInfo:
    """One rank's place: started one process per rank (torchrun, srun with a task per rank)."""

    rank: int
    world_size: int
    init_method: str | None  # None: read MASTER_ADDR/PORT from the environment (torchrun)
    local_rank: int
    local_world_size: int


@dataclass(frozen=True)
class NodeLaunch:
    """One process per node: node `node_rank` of `nnodes` runs ranks [first_rank, first_rank + per_node),
    the first in this process and the others as spawned worker processes."""

    world_size: int
    nnodes: int
    node_rank: int
    init_method: str

    def __post_init__(self) -> None:
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (--tensor-parallel-size x --pipeline-parallel-size) are not a "
                             f"multiple of --nnodes {self.nnodes}: every node runs the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes}) for --nnodes {self.nnodes}")

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.per_node


def single_node(world_size: int) -> NodeLaunch:
    return NodeLaunch(world_size, 1, 0, f"tcp://127.0.0.1:{find_free_port()}")


def torchrun_launch_info() -> LaunchInfo | None:
    """Rank facts when started under torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return LaunchInfo(int(os.environ["RANK"]), world, "env://", int(os.environ.get("LOCAL_RANK", 0)),
                      int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list: 'gpu[01-03,07],login' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login']."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return hosts


def slurm_launch(world_size: int, master_addr: str | None, master_port: int | None,
                 env: dict[str, str] | None = None) -> LaunchInfo | NodeLaunch | None:
    """The launch srun describes (SLURM_PROCID, SLURM_NTASKS...), or None outside srun.

    A task per rank (SLURM_NTASKS == world size: tensor- x pipeline-parallel size) gives a LaunchInfo; a task per node
    (SLURM_NTASKS == SLURM_NNODES) a NodeLaunch that spawns the node's ranks. Rank 0 is task 0, on the
    first node of SLURM_JOB_NODELIST, which is where the other ranks meet unless --master-addr says
    otherwise; the port defaults to 29500 plus the job id modulo 1000, so jobs sharing nodes differ.
    """
    env = os.environ if env is None else env
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    task, ntasks = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    nnodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
    if master_addr is None:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        master_addr = (expand_hostlist(nodelist)[0] if nodelist else env.get("SLURM_LAUNCH_NODE_IPADDR"))
        if not master_addr:
            raise ValueError("under srun without SLURM_JOB_NODELIST or SLURM_LAUNCH_NODE_IPADDR: pass --master-addr")
    if master_port is None:
        master_port = 29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000
    init_method = f"tcp://{master_addr}:{master_port}"
    if ntasks == world_size:
        return LaunchInfo(task, world_size, init_method, int(env.get("SLURM_LOCALID", "0")),
                          max(1, world_size // nnodes))
    if ntasks == nnodes:
        return NodeLaunch(world_size, nnodes, task, init_method)
    raise ValueError(f"srun started {ntasks} tasks on {nnodes} nodes for {world_size} ranks: "
                     f"use one task per rank (--ntasks {world_size}) or one per node (--ntasks-per-node 1)")


def set_cpu_threads(local_world_size: int) -> None:
    # Ranks on one machine share its cores; oversubscribing them slows every rank down.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def worker_main(config: EngineConfig, info: LaunchInfo, log_level: int,
                 worker: Callable[[EngineConfig, RankContext], None], control_token: str) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{info.rank} %(levelname)s %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches every process of the foreground group; a spawned rank leaves it to rank 0,
    # which stops the ranks in order (a shutdown plan), so that stopping does not look like a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_this_process(f"shardserve-r{info.rank}")
    from shardserve.distributed.handshake import StartupMismatch
    from shardserve.distributed.process_group import destroy_rank_context

    set_cpu_threads(info.local_world_size)
    try:
        ctx = init_rank_context(info.rank, info.world_size, config.device, info.init_method, info.local_rank,
                                config, control_token)
    except StartupMismatch:
        sys.exit(1)  # rank 0 reports the mismatch
    try:
        worker(config, ctx)
    finally:
        destroy_rank_context(ctx)


class Ranks(Protocol):
    """An engine's ranks as the supervisor sees them: rank 0's context in this process, the others elsewhere
    (LocalRanks: processes on this machine; ray_ranks.RayRanks: Ray actors)."""

    ctx: RankContext

    def dead_rank(self) -> str | None: ...  # names the first other rank that has ended, None while all run

    def stop_workers(self) -> None: ...  # kill the other ranks now

    def close(self, timeout: float = 30.0) -> None: ...  # leave the group together, then wait for the others


class LocalRanks:
    """This node's ranks: the first in this process, the others spawned as worker processes.

    On a single machine (the default) that is rank 0 plus world_size - 1 workers; with a NodeLaunch,
    node R runs ranks R * per_node ... R * per_node + per_node - 1, and only node 0's first rank drives.
    Spawned ranks run `worker` (a module-level function: the engine's `run_worker`, or a check's) once they have
    joined the group.

    The control token: $SHARDSERVE_CONTROL_TOKEN when set (and it must be, across several nodes), else a
    fresh random one, handed to the spawned ranks as an argument.
    """

    def __init__(self, config: EngineConfig, node: NodeLaunch | None = None,
                 *, worker: Callable[[EngineConfig, RankContext], None]) -> None:
        self.config = config
        node = node or single_node(config.world_size)
        if node.world_size != config.world_size:
            raise ValueError(f"the launch has {node.world_size} ranks but --tensor-parallel-size x "
                             f"--pipeline-parallel-size is {config.world_size}")
        self.node = node
        token = envs.CONTROL_TOKEN.get() or (new_token() if node.nnodes == 1 else resolve_token(None))
        spawn = mp.get_context("spawn")
        self.processes = []
        for local in range(1, node.per_node):
            info = LaunchInfo(node.first_rank + local, node.world_size, node.init_method, local, node.per_node)
            p = spawn.Process(target=worker_main, args=(config, info, logging.getLogger().level, worker, token),
                              name=f"shardserve-rank{info.rank}", daemon=True)
            p.start()
            self.processes.append(p)
        set_cpu_threads(node.per_node)
        try:
            self.ctx: RankContext = init_rank_context(node.first_rank, node.world_size, config.device,
                                                      node.init_method, 0, config, token, exited_rank=self.dead_rank)
        except RankExitedError:
            self.stop_workers()
            raise

    def close(self, timeout: float = 30.0) -> None:
        """Leave the process group, then wait for the other ranks to exit.

        Ranks leave together: NCCL's teardown waits for every rank of the communicator, so rank 0 must
        not wait for the workers to exit before it leaves too (that deadlocks until the timeout).
        """
        from shardserve.distributed.process_group import destroy_rank_context

        destroy_rank_context(self.ctx)
        self.join(timeout)

    def dead_rank(self) -> str | None:
        """A description of the first spawned rank that has exited, or None while all run."""
        pp = self.config.pipeline_parallel_size
        for p in self.processes:
            if not p.is_alive():
                name = p.name.removeprefix('shardserve-')
                if pp > 1:
                    stage = int(name.removeprefix("rank")) // self.config.tensor_parallel_size
                    name += f" (pipeline stage {stage} of {pp})"
                return f"{name} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def stop_workers(self) -> None:
        """Kill this node's spawned ranks now (they are being replaced); SIGKILL also stops a stopped one."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(5)

    def join(self, timeout: float = 30.0) -> None:
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                logger.warning("rank process %s did not exit; terminating it", p.name)
                p.terminate()
