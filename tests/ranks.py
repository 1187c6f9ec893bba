"""Running a function as each rank of a small process group, in processes of their own (CPU, gloo)."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.context import BaseContext
from typing import Callable

from shardserve.distributed.process_group import find_free_port

_CONTEXT: BaseContext | None = None


# What the fork server imports once, so that a forked rank does not: torch, and the engine's rank code with what it
# imports (half a second of CPU a rank on a 2-core machine, paid by every rank of every engine a test starts), and
# torch's C++ extension loader, which loads the CPU kernels of bfloat16 and GGUF weights (half a second more in such
# a rank). Only imports: shardserve reads its environment variables when it runs (shardserve/envs.py), and each rank
# takes the environment of the moment (_run_in), so what a rank does is unchanged.
PRELOAD = ["torch", "torch.distributed", "shardserve.engine.llm_engine", "shardserve.distributed.launcher",
           "torch.utils.cpp_extension"]


def _preload() -> list[str]:
    """PRELOAD, then tests.fork_server_heap (gc.freeze), where the fork server, a new interpreter, finds the shardserve
    and the tests these tests import; else torch only. (Python 3.11's fork server imports with its own sys.path, not
    this process's: the working directory, PYTHONPATH and site-packages. A rank forked from a server that had
    imported another checkout's shardserve would run that code.)"""
    import subprocess
    import sys

    import shardserve
    import tests

    where = "import importlib.util as u; print(u.find_spec('shardserve').origin, u.find_spec('tests').origin)"
    probe = subprocess.run([sys.executable, *subprocess._args_from_interpreter_flags(), "-c", where],
                           capture_output=True, text=True)
    found = probe.stdout.split()
    expected = [shardserve.__file__, tests.__file__]
    if probe.returncode != 0 or len(found) != 2 or not all(
            os.path.isfile(f) and os.path.samefile(f, e) for f, e in zip(found, expected)):
        return PRELOAD[:2]
    return [*PRELOAD, "tests.fork_server_heap"]


def _context() -> BaseContext:
    """On a machine without CUDA, the forkserver context, with torch and the engine's modules imported once in the
    server (_preload()): a rank then starts in a fraction of the seconds a fresh interpreter takes to import them
    (several on a 2-core machine). With CUDA, spawn, as the engine itself starts ranks."""
    global _CONTEXT
    if _CONTEXT is None:
        import torch

        if torch.cuda.is_available():
            _CONTEXT = mp.get_context("spawn")
        else:
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(_preload())
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
