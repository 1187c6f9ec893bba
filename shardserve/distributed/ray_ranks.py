"""Ranks on a Ray cluster (`serve --distributed-executor-backend ray`): rank 0 in this process, ranks 1 to N-1 as Ray
actors that run the same rank code as every other launch (launcher.worker_main), in resources that a placement
group reserves.

Invariants:
- One bundle per rank, all on the node of this process (STRICT_PACK, bundle 0 pinned there, since rank 0 runs here):
  tensor-parallel ranks exchange activations at every layer.
- Missing resources stop start-up at once: what the ranks need is compared with what the cluster and this node have
  before anything is reserved, and a reservation not granted within SHARDSERVE_RAY_RESERVE_TIMEOUT_S (default 20 s)
  is given back and reported, naming the shardserve actors that hold resources.
- Rank actors are named `<name>-r<rank>` in the NAMESPACE namespace; live actors under this server's names (an
  earlier server that did not stop) refuse start-up, naming them.
- The `--forward-env` variables are in an actor's environment from its first instruction (Ray's runtime_env); the
  start-up handshake then applies and compares them as for any launch, with the control token and fingerprints.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Callable, NamedTuple

import torch

from shardserve import envs
from shardserve.config import EngineConfig
from shardserve.distributed.control_token import new_token
from shardserve.distributed.launcher import LaunchInfo, worker_main
from shardserve.distributed.process_group import RankContext, find_free_port, init_rank_context

logger = logging.getLogger(__name__)

NAMESPACE = "shardserve"
ACTOR_START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 5.0
# With it Ray leaves CUDA_VISIBLE_DEVICES alone: every rank sees the node's GPUs (as rank 0 here does, and as the
# fingerprint compares) and picks the one Ray gave its bundle by index.
NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class RayClusterError(RuntimeError):
    """The Ray cluster cannot run the ranks: unreachable, too small, or holding an earlier server's actors."""


class RankActor:
    """The process of one rank on a Ray node (made a Ray actor class by RayRanks)."""

    def where(self) -> tuple[int, str, list[int]]:
        import ray

        return os.getpid(), socket.gethostname(), [int(i) for i in ray.get_gpu_ids()]

    def run(self, config: EngineConfig, info: LaunchInfo, log_level: int,
            worker: Callable[[EngineConfig, RankContext], None], control_token: str, cpus: int, cwd: str) -> None:
        os.chdir(cwd)  # rank 0's working directory, on the same node: a relative model path means the same file
        if config.device == "cuda":
            import ray

            info = dataclasses.replace(info, local_rank=cuda_index(ray.get_gpu_ids()[0]))
        if "OMP_NUM_THREADS" not in config.forward_env:
            threads = rank_threads(cpus, info.local_world_size)
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        worker_main(config, info, log_level, worker, control_token)


def cuda_index(ray_gpu_id) -> int:
    """torch's index of the GPU Ray calls `ray_gpu_id`: Ray numbers the GPUs its node was started with, which are
    CUDA_VISIBLE_DEVICES's list where that is set (the ranks see the same list: the fingerprint compares it)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible.index(str(ray_gpu_id)) if str(ray_gpu_id) in visible else int(ray_gpu_id)


def connect() -> None:
    """Join the cluster at $RAY_ADDRESS, or start one on this machine (once per process)."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        else:
            ray.init(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING)
    except Exception as e:  # noqa: BLE001 - Ray's errors here have no common base
        hint = ("a cluster with token authentication needs RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN "
                "or ~/.ray/auth_token" if "auth" in str(e).lower() else
                "start it with `ray start --head`, or correct RAY_ADDRESS")
        raise RayClusterError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {_first_line(e)}; {hint}") \
            from None
    logger.info("Ray: %s %s (Ray %s)", "joined the cluster at" if address else "started a local cluster",
                address or ray.get_runtime_context().gcs_address, ray.__version__)


def cpus_per_rank(config: EngineConfig, node_cpus: float) -> int:
    """GPU ranks take a core each; CPU ranks share the node's cores, as set_cpu_threads shares a machine's."""
    if config.device == "cuda":
        return 1
    return max(1, int(node_cpus) // config.tensor_parallel_size)


def rank_threads(cpus: int, ranks_on_node: int) -> int:
    """A rank's torch threads: its bundle's CPUs, but no more than its share of the node's cores, which a Ray node
    may count fewer of than it advertises (`ray start --num-cpus`); oversubscribed ranks slow every step down."""
    return max(1, min(cpus, (os.cpu_count() or 1) // ranks_on_node))


def shortfall(need: dict[str, float], cluster: dict[str, float], node: dict[str, float], node_ip: str) -> list[str]:
    """One line per resource the ranks need more of than the cluster, or this node, has in all."""
    lines = []
    for resource, amount in need.items():
        if cluster.get(resource, 0) < amount:
            lines.append(f"{amount:g} {resource} needed, the cluster has {cluster.get(resource, 0):g} in all")
        elif node.get(resource, 0) < amount:
            lines.append(f"{amount:g} {resource} needed on node {node_ip} (rank 0 runs there and the ranks are packed "
                         f"on one node), it has {node.get(resource, 0):g}")
    return lines


def this_node() -> tuple[str, dict[str, float]]:
    """The address and the resources of the Ray node this process runs on (where rank 0 runs)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node["NodeManagerAddress"], dict(node.get("Resources", {}))
    raise RayClusterError(f"this process's Ray node {node_id} is not among the cluster's nodes: run `shardserve serve` "
                          f"on a node of the cluster (rank 0 runs in it)")


def shardserve_actors() -> list[str]:
    """The names of the live actors in the shardserve namespace (ranks of this or other servers)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE)


class Placement(NamedTuple):
    node_ip: str  # rank 0's node, where every rank runs
    cpus: int  # per rank
    bundle: dict[str, float]  # what each rank reserves


def plan_placement(config: EngineConfig, name: str, stale_wait_s: float = 0.0) -> Placement:
    """Connect to the cluster and size the ranks' bundles; refuse at once (RayClusterError) an earlier server's
    live actors under `name` (still there after `stale_wait_s`) and a cluster, or a node, without the resources.
    Also run before the API servers start, so that a refusal comes in seconds."""
    connect()
    _refuse_stale(name, stale_wait_s)
    node_ip, node_resources = this_node()
    cpus = cpus_per_rank(config, node_resources.get("CPU", 1))
    bundle = {"CPU": float(cpus), **({"GPU": 1.0} if config.device == "cuda" else {})}
    import ray

    need = _need(bundle, config.tensor_parallel_size)
    missing = shortfall(need, ray.cluster_resources(), node_resources, node_ip)
    if missing:
        raise RayClusterError(
            f"the Ray cluster is too small for {config.tensor_parallel_size} ranks of {_describe(bundle)} each: "
            f"{'; '.join(missing)}. Add nodes or resources, or lower --tensor-parallel-size")
    return Placement(node_ip, cpus, bundle)


def preflight(config: EngineConfig, name: str) -> None:
    """Before the API servers start, so that a refusal comes in seconds: plan_placement's checks, then up to
    SHARDSERVE_RAY_RESERVE_TIMEOUT_S for the cluster to have the ranks' resources free, else a RayClusterError naming
    what is short and the shardserve actors that hold resources."""
    import ray

    placement = plan_placement(config, name)
    need = _need(placement.bundle, config.tensor_parallel_size)
    deadline = time.monotonic() + envs.RAY_RESERVE_TIMEOUT_S.get()
    while short := _short_of(need, ray.available_resources()):
        if time.monotonic() >= deadline:
            raise RayClusterError(_not_free(config.tensor_parallel_size, placement, short))
        time.sleep(0.5)


def _short_of(need: dict[str, float], free: dict[str, float]) -> list[str]:
    return [f"{need[k]:g} {k} needed, {free.get(k, 0):g} free in the cluster" for k in need
            if not k.startswith("node:") and free.get(k, 0) < need[k]]


def _not_free(world_size: int, placement: Placement, short: list[str]) -> str:
    others = shardserve_actors()
    return (f"Ray did not have {world_size} bundles of {_describe(placement.bundle)} free on node {placement.node_ip} "
            f"within {envs.RAY_RESERVE_TIMEOUT_S.get():g} s: {'; '.join(short) or 'other work holds them'}"
            + (f"; shardserve actors holding resources: {', '.join(others)}" if others else "")
            + ". Stop what holds them (`ray list actors`), or lower --tensor-parallel-size")


def _refuse_stale(name: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:  # a restart's killed actors leave the list a moment after their deaths are known
        live = shardserve_actors()
        mine = [n for n in live if n.startswith(f"{name}-r")]
        if not mine or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if mine:
        raise RayClusterError(
            f"Ray actors of an earlier server under this server's names are still alive: {', '.join(mine)} "
            f"(namespace {NAMESPACE}); stop that server, or remove them: python -c \"import ray; "
            f"ray.init(namespace='{NAMESPACE}'); [ray.kill(ray.get_actor(n)) for n in {mine!r}]\"")
    if live:
        logger.info("Ray: other shardserve actors on this cluster: %s", ", ".join(live))


def _need(bundle: dict[str, float], world_size: int) -> dict[str, float]:
    return {k: v * world_size for k, v in bundle.items()}


class RayRanks:
    """The ranks of one engine on a Ray cluster: `.ctx` is rank 0's context in this process, `dead_rank()` names
    an actor that has died, `stop_workers()` kills the actors, `close()` leaves the group and frees the bundles.
    The same interface as LocalRanks, so the supervisor restarts them alike."""

    def __init__(self, config: EngineConfig, *, worker: Callable[[EngineConfig, RankContext], None],
                 name: str) -> None:
        from ray.util.placement_group import placement_group

        self.config, self.name = config, name
        self.world_size = config.tensor_parallel_size
        self.actors: list = []
        self._runs: dict = {}  # run ObjectRef -> rank
        self._where: dict[int, str] = {}
        self._dead: str | None = None
        node_ip, cpus, bundle = plan_placement(config, name, stale_wait_s=STOP_TIMEOUT_S)
        bundles = [dict(bundle) for _ in range(self.world_size)]
        bundles[0][f"node:{node_ip}"] = 0.001  # rank 0 is this process
        self.pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{name}-ranks")
        try:
            self._wait_reserved(bundle, node_ip)
            local_rank0 = self._start_actors(cpus)
            init_method = f"tcp://{node_ip}:{find_free_port()}"
            token = envs.CONTROL_TOKEN.get() or new_token()
            level = logging.getLogger().level
            others = self.actors[len(self.actors) - (self.world_size - 1):]  # ranks 1 to N-1, after any in bundle 0
            for actor, rank in zip(others, range(1, self.world_size)):
                info = LaunchInfo(rank, self.world_size, init_method, 0, self.world_size)
                self._runs[actor.run.remote(config, info, level, worker, token, cpus, os.getcwd())] = rank
            if "OMP_NUM_THREADS" not in os.environ:
                torch.set_num_threads(rank_threads(cpus, self.world_size))
            self.ctx: RankContext = init_rank_context(0, self.world_size, config.device, init_method, local_rank0,
                                                      config, token, exited_rank=self.dead_rank)
        except BaseException:
            self.stop_workers()
            self._release()
            raise

    # -- start-up ------------------------------------------------------------------------------
    def _start_actors(self, cpus: int) -> int | None:
        """An actor per rank but rank 0 (on GPUs one in bundle 0 too, that tells rank 0 its GPU), each in its
        bundle with the forwarded variables in its environment; returns rank 0's GPU on GPUs, else None."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(RankActor)
        env = {k: os.environ[k] for k in self.config.forward_env if k in os.environ}
        gpus = 1 if self.config.device == "cuda" else 0
        if gpus:
            env[NOSET_CUDA_ENV] = "1"
        first = 0 if gpus else 1
        for rank in range(first, self.world_size):
            self.actors.append(actor_class.options(
                name=f"{self.name}-r{rank}", namespace=NAMESPACE, num_cpus=cpus if rank else 0, num_gpus=gpus,
                max_restarts=0, runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote())
        return self._started(first)

    def _wait_reserved(self, bundle: dict[str, float], node_ip: str) -> None:
        import ray

        ready, _ = ray.wait([self.pg.ready()], timeout=envs.RAY_RESERVE_TIMEOUT_S.get())
        if not ready:
            short = _short_of(_need(bundle, self.world_size), ray.available_resources())
            raise RayClusterError(_not_free(self.world_size, Placement(node_ip, 0, bundle), short))

    def _started(self, first: int) -> int | None:
        """Wait for the actors to start; log where each runs. Returns rank 0's GPU on GPUs, else None."""
        import ray

        try:
            places = ray.get([a.where.remote() for a in self.actors], timeout=ACTOR_START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a runtime env that failed, an import error, a timeout
            raise RayClusterError(f"the rank actors did not start on Ray: {_first_line(e)}") from None
        for rank, (pid, host, gpus) in enumerate(places, start=first):
            self._where[rank] = f"rank{rank} (Ray actor {self.name}-r{rank}, pid {pid} on {host})"
            logger.info("Ray: %s%s", self._where[rank], f", GPU {gpus}" if gpus else "")
        return cuda_index(places[0][2][0]) if first == 0 else None

    # -- the LocalRanks interface -----------------------------------------------------------------
    def dead_rank(self) -> str | None:
        """A description of the first rank actor that has ended, or None while all run."""
        import ray

        if self._dead is not None or not self._runs:
            return self._dead
        done, _ = ray.wait(list(self._runs), num_returns=1, timeout=0)
        if not done:
            return None
        rank = self._runs[done[0]]
        try:
            ray.get(done[0], timeout=0)
            how = "exited"
        except Exception as e:  # noqa: BLE001 - an actor that died or a rank that raised
            how = f"died: {_first_line(e)}"
        self._dead = f"{self._where.get(rank, f'rank{rank}')} {how}"
        return self._dead

    def close(self, timeout: float = 30.0) -> None:
        """Leave the process group with the other ranks (NCCL's teardown is collective), wait for them to end,
        then free their actors and bundles."""
        import ray

        from shardserve.distributed.process_group import destroy_rank_context

        destroy_rank_context(self.ctx)
        if self._runs:
            done, running = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=timeout)
            if running:
                logger.warning("Ray: %d rank actor(s) did not end within %.0f s; killing them", len(running), timeout)
        self.stop_workers()
        self._release()

    def stop_workers(self) -> None:
        """Kill the rank actors now (they are being replaced, or start-up failed); a rank that ended with an
        error has it logged first, since its output is in Ray's logs, not here."""
        import ray

        self._log_errors()
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._runs:
            ray.wait(list(self._runs), num_returns=len(self._runs), timeout=STOP_TIMEOUT_S)

    def _log_errors(self) -> None:
        import ray

        if not self._runs:
            return
        done, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=0)
        for ref in done:
            rank = self._runs.pop(ref)
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                pass  # killed or lost: dead_rank() said so
            except Exception as e:  # noqa: BLE001 - the rank's own error, with its traceback
                logger.error("Ray: rank %d failed: %s", rank, e)

    def _release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - never reserved, or already removed
            pass


def _describe(bundle: dict[str, float]) -> str:
    return " + ".join(f"{v:g} {k}" for k, v in bundle.items() if not k.startswith("node:"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

