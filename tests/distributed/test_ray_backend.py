"""`serve --distributed-executor-backend ray` on a local Ray head (CPU): the same greedy tokens as the default mp
backend, --forward-env reaching the rank actors through Ray, a killed rank actor failing the stream, turning
/health 503 and restarting as local ranks do, and a cluster that is too small, or holds an earlier server's actors,
refusing start-up at once by name.

One head for the module (`ray start --head --block`, 4 CPUs, stopped by SIGTERM, which stops what it started and
nothing of another head on this machine); the servers run one at a time, since a -tp 2 server takes its 4 CPUs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from shardserve.distributed.process_group import find_free_port
from tests.helpers.rank_faults import greedy, openai_client, stream_in_background, wait_for_health
from tests.serving import serve_cli, stop_processes

# Only where Ray is missing (the test extra installs it): skipped, saying so, never silently.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed: pip install -e '.[test]' (or '.[ray]') brings it")

HEAD_CPUS = 4
NAMESPACE = "shardserve"


@pytest.fixture(scope="module")
def ray_address():
    """A Ray head on this machine, its address; stopped with the module. It takes a token of its own (Ray's token
    authentication), which this process, and so the servers it starts, hold for the module: a token another Ray
    left in ~/.ray/auth_token changes nothing."""
    port = find_free_port()
    temp_dir = tempfile.mkdtemp(prefix="ssray-", dir="/tmp")  # Ray's socket paths must stay short
    script = Path(sys.executable).with_name("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "token")
        patch.setenv("RAY_AUTH_TOKEN", uuid.uuid4().hex)
        patch.delenv("RAY_ADDRESS", raising=False)
        head = subprocess.Popen(
            [str(script) if script.exists() else "ray", "start", "--head", "--block", "--port", str(port),
             "--num-cpus", str(HEAD_CPUS), "--include-dashboard=false", "--disable-usage-stats",
             "--object-store-memory", "200000000", "--temp-dir", temp_dir],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_started(head)
            yield f"127.0.0.1:{port}"
        finally:
            stop_processes([head], signal.SIGTERM, 30)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_started(head: subprocess.Popen) -> None:
    started = time.monotonic()
    for line in head.stdout:
        if "block forever" in line:
            break
        assert time.monotonic() - started < 120, "the Ray head did not start within 120 s"
    else:
        pytest.fail(f"`ray start --head` exited with {head.wait()}")
    threading.Thread(target=head.stdout.read, daemon=True).start()  # its pipe must never fill up


@pytest.fixture(scope="module")
def ray_client(ray_address):
    """This process connected to the head as a driver: it kills rank actors and plays an earlier server."""
    import ray

    ray.init(address=ray_address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _ray_args(*more: str) -> list[str]:
    return ["--device", "cpu", "--distributed-executor-backend", "ray", *more]


def _completions(url: str, prompts: list[str]) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return [client.completions.create(model="smol", prompt=p, max_tokens=16, temperature=0).choices[0].text
            for p in prompts]


def _processes_with(variable: str, value: str) -> list[int]:
    """Pids of shardserve rank processes whose environment held variable=value when they started."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and (proc / "comm").read_text().strip() == "shardserve-r1"
                    and f"{variable}={value}".encode() in (proc / "environ").read_bytes().split(b"\0")):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@needs_ray
def test_tp2_on_ray_gives_the_mp_backends_greedy_tokens_and_forwards_env(tiny_model_dir, ray_address):
    """A tiny random model (the real one's TP=2 answer is checked on the mp backend, test_real_engine_serving)."""
    prompts = ["w3 w7 w9 w11", "w40 w2"]
    common = [tiny_model_dir("llama-untied"), "-tp", "2", "--device", "cpu", "--served-model-name", "smol",
              "--kv-cache-memory", "0.05"]
    with serve_cli(common) as url:
        expected = _completions(url, prompts)
    mark = uuid.uuid4().hex
    with serve_cli([*common, "--distributed-executor-backend", "ray", "--forward-env", "SHARDSERVE_RAY_TEST_MARK"],
                   env={"RAY_ADDRESS": ray_address, "SHARDSERVE_RAY_TEST_MARK": mark}) as url:
        assert _completions(url, prompts) == expected
        assert all(expected)  # 16 greedy tokens of text each
        # The rank actor was started by the head's raylet (not by the server) with the variable already set.
        actors = _processes_with("SHARDSERVE_RAY_TEST_MARK", mark)
        assert len(actors) == 1, actors
        assert Path(f"/proc/{actors[0]}/cmdline").read_text().startswith("ray::"), "rank 1 is not a Ray actor"


@needs_ray
def test_a_killed_rank_actor_fails_the_stream_turns_health_503_restarts_then_exits_when_restarts_are_used(
        tiny_model_dir, ray_address, ray_client):
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve", "serve", tiny_model_dir("llama-untied"), "-tp", "2",
         "--served-model-name", "tiny", "--kv-cache-memory", "0.05", "--max-restarts", "1", "--port", str(port),
         *_ray_args()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ray_address})
    try:
        wait_for_health(proc, url, 200, timeout=120)
        client = openai_client(url)
        before = greedy(client)

        def kill_rank1_at_third_chunk(chunks: int) -> None:
            if chunks == 3:
                ray_client.kill(ray_client.get_actor(f"shardserve-{port}-r1", namespace=NAMESPACE))

        stream = stream_in_background(client, kill_rank1_at_third_chunk)
        assert wait_for_health(proc, url, 503, timeout=10) < 10
        assert "rank1" in httpx.get(f"{url}/health", timeout=2).json()["error"]["message"]
        stream["thread"].join(timeout=60)
        assert "error" in stream and stream["chunks"] < 480, "the stream must end with an error"

        wait_for_health(proc, url, 200, timeout=90)
        health = httpx.get(f"{url}/health", timeout=2).json()
        assert health["restarts"] == 1 and f"shardserve-{port}-r1" in health["last_failure"], health
        assert greedy(client) == before, "after the restart the server gives the same tokens"

        stream = stream_in_background(client, kill_rank1_at_third_chunk)  # --max-restarts 1 is used up
        stream["thread"].join(timeout=60)
        assert "error" in stream
        code = proc.wait(timeout=60)
        output = proc.stdout.read()
        assert code == 1 and "--max-restarts 1 used up" in output, output
    finally:
        stop_processes([proc], signal.SIGINT, 30)


def _refused(model: str, ray_address: str, *args: str, port: int | None = None,
             env: dict[str, str] | None = None) -> tuple[str, float]:
    """The output of a server that must refuse to start, and the seconds it took."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "shardserve", "serve", model, "--port", str(port or find_free_port()), *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": ray_address, **(env or {})})
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr, time.monotonic() - started


@needs_ray
def test_more_cpus_than_the_cluster_has_fail_at_once_naming_the_shortfall(tiny_model_dir, ray_address):
    output, seconds = _refused(tiny_model_dir("llama-untied"), ray_address, "-tp", "8", *_ray_args())
    assert seconds < 30
    assert f"8 CPU needed, the cluster has {HEAD_CPUS} in all" in output, output


@needs_ray
def test_an_earlier_servers_live_actors_are_named(tiny_model_dir, ray_address, ray_client):
    port = find_free_port()

    @ray_client.remote(num_cpus=0)
    class Leftover:
        pass

    leftover = Leftover.options(name=f"shardserve-{port}-r1", namespace=NAMESPACE).remote()
    try:
        output, seconds = _refused(tiny_model_dir("llama-untied"), ray_address, "-tp", "2", *_ray_args(), port=port)
        assert seconds < 30
        assert f"still alive: shardserve-{port}-r1" in output, output
    finally:
        ray_client.kill(leftover)


def test_without_ray_the_flag_names_the_extra_to_install(monkeypatch, tiny_model_dir):
    """Where Ray is missing, the flag says how to install it instead of failing on an import (runs either way)."""
    from shardserve.cli import parse_args
    from shardserve.entrypoints import serve

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    args = parse_args(["serve", tiny_model_dir("llama-untied"), "-tp", "2", *_ray_args()])
    with pytest.raises(SystemExit, match=r"needs Ray: pip install 'shardserve\[ray\]'"):
        serve.serve(args)


@needs_ray
def test_a_rank_actor_whose_environment_differs_from_rank_0s_stops_start_up_naming_it(tiny_model_dir, ray_address):
    """The Ray node's workers have the environment the node was started with, not the server's: the handshake
    names a behaviour-changing variable that differs, and --forward-env then makes them agree."""
    model = tiny_model_dir("llama-untied")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "shardserve", "serve", model, "--port", str(find_free_port()), "-tp", "2", *_ray_args(),
         "--api-server-count", "0"],  # a front end still starting would take 30 s to stop
        capture_output=True, text=True, timeout=90,
        env={**os.environ, "RAY_ADDRESS": ray_address, "NCCL_DEBUG": "WARN"})
    output = done.stdout + done.stderr
    assert done.returncode == 1 and time.monotonic() - started < 60, output
    assert "start-up stopped" in output and "NCCL_DEBUG differs" in output and "--forward-env" in output, output


def test_the_shortfall_names_each_missing_resource_and_where():
    from shardserve.distributed.ray_ranks import shortfall

    need = {"CPU": 8.0, "GPU": 8.0}
    assert shortfall(need, {"CPU": 16.0, "GPU": 8.0}, {"CPU": 16.0, "GPU": 8.0}, "10.0.0.1") == []
    assert shortfall(need, {"CPU": 4.0, "GPU": 16.0}, {"CPU": 4.0, "GPU": 4.0}, "10.0.0.1") == [
        "8 CPU needed, the cluster has 4 in all",
        "8 GPU needed on node 10.0.0.1 (rank 0 runs there and the ranks are packed on one node), it has 4"]


def test_a_rank_runs_its_bundles_cpus_in_threads_but_no_more_than_its_share_of_the_real_cores(monkeypatch):
    from shardserve.distributed import ray_ranks

    monkeypatch.setattr(ray_ranks.os, "cpu_count", lambda: 2)
    assert ray_ranks.rank_threads(2, 2) == 1  # a head started with --num-cpus 4 on 2 cores
    monkeypatch.setattr(ray_ranks.os, "cpu_count", lambda: 64)
    assert ray_ranks.rank_threads(16, 4) == 16


def test_rays_gpu_ids_become_torch_indexes_within_cuda_visible_devices(monkeypatch):
    from shardserve.distributed.ray_ranks import cuda_index

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_index(3) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert cuda_index("6") == 2


@needs_ray
def test_resources_that_other_work_holds_are_waited_for_then_refused_naming_the_holders(tiny_model_dir, ray_address,
                                                                                          ray_client):
    @ray_client.remote(num_cpus=HEAD_CPUS // 2)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.options(name="shardserve-elsewhere-r1", namespace=NAMESPACE).remote()
    try:
        ray_client.get(holder.ready.remote(), timeout=60)
        output, seconds = _refused(tiny_model_dir("llama-untied"), ray_address, "-tp", "2", *_ray_args(),
                                   env={"SHARDSERVE_RAY_RESERVE_TIMEOUT_S": "3"})
        assert seconds < 30, output
        assert "within 3 s" in output, output
        assert (f"{HEAD_CPUS} CPU needed, {HEAD_CPUS // 2} free in the cluster" in output
                and "shardserve actors holding resources: shardserve-elsewhere-r1" in output), output
    finally:
        ray_client.kill(holder)
