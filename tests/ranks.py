"""Running a function as each rank of a small process group, in processes of their own (CPU, gloo)."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.context import BaseContext
from typing import Callable

from shardserve.distributed.process_group import find_free_port

_CONTEXT: BaseContext | None = None


def _context() -> BaseContext:
    """On a machine without CUDA, the forkserver context, with torch imported once in the server: a rank then
    starts in a fraction of the seconds a fresh interpreter takes to import torch (several on a 2-core machine).
    With CUDA, spawn, as the engine itself starts ranks."""
    global _CONTEXT
    if _CONTEXT is None:
        import torch

        if torch.cuda.is_available():
            _CONTEXT = mp.get_context("spawn")
        else:
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


def _run_in(env: dict[str, str], target: Callable, *args) -> None:
    """target(*args) in the caller's environment of the moment (the fork server holds the one it started in)."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


class ForkedRanks:
    """multiprocessing's context as shardserve.distributed.launcher uses it ("spawn"), but forking each rank from
    the torch-importing server above, with the environment of the moment: during the tests, an engine's ranks
    run the launcher's own worker code from the start, only without the seconds of importing torch again."""

    def get_context(self, method: str | None = None) -> BaseContext | ForkedRanks:
        return self if method == "spawn" else mp.get_context(method)

    def Process(self, target: Callable, args: tuple = (), **kwargs):  # noqa: N802 - multiprocessing's name
        return _context().Process(target=_run_in, args=(dict(os.environ), target, *args), **kwargs)


def run_ranks(target: Callable, world_size: int, *args, timeout: float = 120) -> dict[int, str]:
    """Start target(rank, port, *args, results) for every rank; returns {rank: what it put in results}.

    `target` must be a module-level function; each rank puts one (rank, outcome) pair into `results`. Each rank
    is a fresh process (without CUDA, forked from a server that has only imported torch) with this process's
    environment.
    """
    context = _context()
    results = context.Queue()
    port = find_free_port()
    env = dict(os.environ)
    procs = [context.Process(target=_run_in, args=(env, target, rank, port, *args, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(30)
    return outcome


def start_model_runner(rank: int, port: int, model_dir: str, results, control_token: str,
                       handshake: bool = False) -> None:
    """As one rank of a 2-rank CPU group, build a ModelRunner for `model_dir` (start-up: load, checks) and put
    (rank, "started") or (rank, "ErrorType: message") into `results`. With `handshake` the ranks also compare
    their configs when the group starts."""
    import torch

    from shardserve.config import EngineConfig, ModelConfig
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
    from shardserve.engine import model_runner

    torch.set_num_threads(1)
    config = EngineConfig(model=model_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory_gb=0.02)
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", config=config if handshake else None,
                            control_token=control_token)
    try:
        model_runner.ModelRunner(config, ModelConfig.from_model_path(model_dir), ctx)
        results.put((rank, "started"))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx)
