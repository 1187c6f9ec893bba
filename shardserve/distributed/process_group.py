"""Joining the rank group: the data plane (NCCL on GPUs, gloo on CPU) and a gloo control plane."""

from __future__ import annotations

import datetime
import logging
import random
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardserve import envs
from shardserve.config import EngineConfig
from shardserve.distributed.communicator import SINGLE, Communicator
from shardserve.distributed.control_token import (
    TOKEN_ENV,
    ControlTokenError,
    authenticate_ranks,
    control_key,
    resolve_token,
)
from shardserve.distributed.handshake import handshake
from shardserve.distributed.plan_stream import rendezvous_host
from shardserve.distributed.setup_watchdog import setup_step

logger = logging.getLogger(__name__)

# Collectives fail after this long instead of hanging forever. Idle ranks are kept alive by
# keep-alive plans from rank 0, so only a dead or stuck rank ever reaches it.
def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=envs.COLLECTIVE_TIMEOUT_S.get())


TEARDOWN_TIMEOUT_S = 30.0


@dataclass
class RankContext:
    """One rank's place. Ranks are tensor-parallel inner: rank = stage * tp_size + tp_rank, so a stage's ranks are
    consecutive (on one node where each node holds whole stages). `comm` spans this rank's stage only; the control
    plane (step plans, lockstep) and the pipeline's sends between stages span the world."""

    rank: int
    world_size: int
    device: torch.device
    comm: Communicator  # data plane: activations, over this stage's tensor-parallel group
    control_group: dist.ProcessGroup | None  # control plane: step plans, always gloo (CPU tensors), every rank
    control_key: bytes | None = None  # signs the step plans (distributed/control_token.py); None: one rank
    rendezvous_host: str | None = None  # rank 0's address that every rank reached to join (plan_stream.py)
    pp_size: int = 1  # pipeline stages; world_size = pp_size * tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def tp_size(self) -> int:
        return self.world_size // self.pp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    def describe_rank(self, rank: int) -> str:
        """'rank R' and, with several stages, its stage: what errors about a rank say."""
        return describe_rank(rank, self.tp_size, self.pp_size)


def describe_rank(rank: int, tp_size: int, pp_size: int) -> str:
    if pp_size == 1:
        return f"rank {rank}"
    return f"rank {rank} (pipeline stage {rank // tp_size} of {pp_size}, tensor-parallel rank {rank % tp_size})"


# Where the kernel takes the ports of outgoing connections (Linux's net.ipv4.ip_local_port_range), and the lowest port
# find_free_port picks below it.
EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_LISTEN_PORT = 20000


def _ephemeral_start() -> int | None:
    try:
        with open(EPHEMERAL_PORTS) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def find_free_port() -> int:
    """A port nothing listens on now, for a server this process or its ranks start in a moment. Chosen below the
    kernel's range for outgoing connections where there is room: a port asked of the kernel (bind to port 0) comes
    from that range, where every connection another process opens meanwhile may take it before the server binds
    (a TCP store failed so with EADDRINUSE in a test run beside another worker's connections)."""
    start = _ephemeral_start()
    if start is not None and start > LOWEST_LISTEN_PORT:
        below = range(LOWEST_LISTEN_PORT, start)
        for port in random.SystemRandom().sample(below, min(64, len(below))):  # not the seeded generator
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_context(device: str) -> RankContext:
    return RankContext(0, 1, torch.device(device), SINGLE, None)


class RankExitedError(RuntimeError):
    """A rank process this one started exited before it joined the group: start-up cannot complete."""


# Every spawned rank imports the script that started the engine again (multiprocessing's spawn method).
MAIN_GUARD_HINT = ("a script that starts several ranks must create the engine under `if __name__ == \"__main__\":`, "
                   "because each rank's process imports the script again")


def init_rank_context(rank: int, world_size: int, device: str, init_method: str | None = None,
                      local_rank: int | None = None, config: EngineConfig | None = None,
                      control_token: str | None = None, exited_rank=None, pp_size: int | None = None
                      ) -> RankContext:
    """Join the process group (from env:// under torchrun, else init_method) and build both planes.

    First, on the rendezvous store, the ranks prove to each other that they hold the launch's control
    token (`control_token`, else $SHARDSERVE_CONTROL_TOKEN; distributed/control_token.py). Then, with
    `config`, the start-up handshake (distributed/handshake.py): forwarded variables are applied and
    the ranks' fingerprints compared before NCCL or gloo read any variable and before any weights load.
    `exited_rank` (rank 0 of a launch that spawned its node's other ranks): a function naming a spawned rank
    that has exited, or None; the wait for the ranks to connect stops with RankExitedError when it names one.
    `pp_size` (default: the config's pipeline_parallel_size, else 1): the world is that many stages of ranks, each
    stage with a data-plane group of its own.
    """
    if pp_size is None:
        pp_size = config.pipeline_parallel_size if config is not None else 1
    if world_size % pp_size:
        raise ValueError(f"{world_size} ranks do not split into {pp_size} pipeline stages of equal size")
    if world_size == 1:  # no process group: nothing to communicate with
        if device == "cuda":
            torch.cuda.set_device(0)
        return single_rank_context("cuda:0" if device == "cuda" else "cpu")
    if config is not None and TOKEN_ENV in config.forward_env:
        raise ControlTokenError(f"{TOKEN_ENV} cannot be forwarded: --forward-env (and a recipe's env:) send values "
                                f"through the rendezvous store in the clear; set it on every node instead")
    key = control_key(resolve_token(control_token))
    store = _rendezvous(init_method or "env://", rank, world_size, exited_rank)
    authenticate_ranks(store, rank, world_size, key)
    if config is not None:
        handshake(store, rank, world_size, config)
    store = dist.PrefixStore("default_pg", store)
    with setup_step("join the process groups", rank):
        torch_device = _join_groups(store, rank, world_size, device, local_rank)
    control_group = dist.new_group(backend="gloo", timeout=collective_timeout())
    comm = _stage_communicator(rank, world_size, pp_size)
    return RankContext(rank, world_size, torch_device, comm, control_group, key,
                       rendezvous_host(init_method or "env://"), pp_size)


def _stage_communicator(rank: int, world_size: int, pp_size: int) -> Communicator:
    """The data plane of this rank's stage: the world itself with one stage; else a group of the stage's ranks
    (every rank creates every stage's group, in stage order, as torch requires)."""
    if pp_size == 1:
        return Communicator(dist.group.WORLD, rank, world_size)
    tp = world_size // pp_size
    if tp == 1:
        return Communicator(None, 0, 1)
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=collective_timeout())
              for s in range(pp_size)]
    return Communicator(groups[rank // tp], rank % tp, tp)


def _rendezvous(init_method: str, rank: int, world_size: int, exited_rank) -> dist.Store:
    """The rendezvous store once every rank has connected. Rank 0 hosts it, and torch waits for the others
    inside native code for up to collective_timeout(); with `exited_rank` that wait runs in a thread while this one
    checks the spawned ranks, so one that died first (a script without a main guard, an import error) stops
    start-up at once, naming it, instead of at the timeout."""
    def join() -> dist.Store:
        return next(dist.rendezvous(init_method, rank, world_size, timeout=collective_timeout()))[0]

    if exited_rank is None:
        return join()
    outcome: dict = {}

    def connect() -> None:
        try:
            outcome["store"] = join()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = e

    waiter = threading.Thread(target=connect, name="shardserve-rendezvous", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.2)
        exited = exited_rank() if waiter.is_alive() else None
        if exited is not None:
            waiter.join(1.0)  # it may have connected just before it exited: then the handshake reports it
            if waiter.is_alive():
                raise RankExitedError(f"{exited} before it connected to rank 0, so start-up stops here (its "
                                      f"error is above); {MAIN_GUARD_HINT}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["store"]


def _join_groups(store, rank: int, world_size: int, device: str, local_rank: int | None) -> torch.device:
    """The data plane's default group: NCCL on this rank's GPU, or gloo on CPU."""
    if device == "cuda":
        local = local_rank if local_rank is not None else rank % max(torch.cuda.device_count(), 1)
        torch_device = torch.device("cuda", local)
        torch.cuda.set_device(torch_device)
        # device_id binds NCCL to this GPU eagerly; without it barriers have been seen to hang.
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                timeout=collective_timeout(), device_id=torch_device)
    else:
        torch_device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=collective_timeout())
    return torch_device


def destroy_rank_context(ctx: RankContext, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Leave the process group. Every rank calls this at about the same time (NCCL's teardown is
    collective). It waits at most timeout_s: a teardown that does not finish is logged and left to
    process exit, so shutting down never hangs."""
    if ctx.world_size == 1 or not dist.is_initialized():
        return
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="shardserve-group-teardown", daemon=True).start()
    if not done.wait(timeout_s):
        logger.error("rank %d: the process group did not tear down within %.0f s; leaving it to process exit",
                     ctx.rank, timeout_s)
