"""`shardserve pool`: two models behind one endpoint with room for one awake at a time. Concurrent
requests to both all complete with the tokens each model gives alone; none is lost; the models swap."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import httpx
import openai
import pytest

from shardserve.entrypoints.llm import LLM
from shardserve.pool.config import PoolConfigError, check_model_paths, load_pool_config
from shardserve.requests.sampling_params import SamplingParams
from tests.pool.running import running_pool, write_config

PROMPTS = ["w1 w2 w3", "w9 w8", "w30 w31 w32 w33"]


def _expected(model_dir: str) -> dict[str, str]:
    with LLM(model_dir, kv_cache_memory_gb=0.05) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


def test_two_models_in_room_for_one_serve_concurrent_requests_without_losing_any(tiny_model_dir, tmp_path):
    dirs = {"llama": tiny_model_dir("llama-untied"), "qwen": tiny_model_dir("qwen3")}
    expected = {name: _expected(d) for name, d in dirs.items()}
    config = {"memory_budget_gb": 1, "models": [
        {"name": name, "model": d, "memory_gb": 1, "args": ["--kv-cache-memory", "0.05"]} for name, d in dirs.items()]}
    with running_pool(write_config(tmp_path, config)) as pool:
        url = pool.url
        states = {m["id"]: m["state"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert sorted(states.values()) == ["asleep", "awake"], "room for one: the other sleeps"

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(job):
            name, prompt, stream = job
            kwargs = dict(model=name, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
            if stream:
                return name, prompt, "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
            return name, prompt, client.completions.create(**kwargs).choices[0].text

        jobs = [(name, p, i % 2 == 0) for i, (name, p) in enumerate((n, p) for p in PROMPTS for n in dirs)] * 2
        with concurrent.futures.ThreadPoolExecutor(8) as executor:
            answers = list(executor.map(ask, jobs))
        assert len(answers) == len(jobs)
        for name, prompt, text in answers:
            assert text == expected[name][prompt], (name, prompt)
        wakes = {m["id"]: m["wakes"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert sum(wakes.values()) >= 1, "the models took turns"

        missing = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "w1"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "llama" in missing.json()["error"]["message"]
        unnamed = httpx.post(f"{url}/v1/completions", json={"prompt": "w1"})
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
        assert "names no model" in unnamed.json()["error"]["message"] and "None" not in unnamed.json()["error"]["message"]


def test_config_errors_name_the_key(tmp_path):
    def load(config: dict):
        return load_pool_config(write_config(tmp_path, config))

    with pytest.raises(PoolConfigError, match=r"models\.0\.memory_gb: Input should be greater than 0"):
        load({"models": [{"name": "a", "model": "/m", "memory_gb": 0}]})
    with pytest.raises(PoolConfigError, match=r"models\.0\.colour: Extra inputs are not permitted"):
        load({"models": [{"name": "a", "model": "/m", "memory_gb": 1, "colour": 1}]})
    with pytest.raises(PoolConfigError, match="model names must be unique, repeated: a"):
        load({"models": [{"name": "a", "model": "/m", "memory_gb": 1}] * 2})
    with pytest.raises(PoolConfigError, match="memory_gb of a exceeds memory_budget_gb 2: it could never be awake"):
        load({"memory_budget_gb": 2, "models": [{"name": "a", "model": "/m", "memory_gb": 3}]})
    with pytest.raises(PoolConfigError, match=r"models\.0\.args: Value error, --port are set by the pool"):
        load({"models": [{"name": "a", "model": "/m", "memory_gb": 1, "args": ["--port", "1"]}]})


def test_model_paths_are_checked_at_start_and_relative_to_the_config(tiny_model_dir, tmp_path):
    import shutil

    shutil.copytree(tiny_model_dir("llama-tied"), tmp_path / "models" / "tiny")
    config = load_pool_config(write_config(tmp_path, {"models": [
        {"name": "a", "model": "models/tiny", "memory_gb": 1}]}))
    assert config.models[0].model == str(tmp_path / "models" / "tiny")
    check_model_paths(config)
    result = subprocess.run([sys.executable, "-m", "shardserve", "pool", write_config(tmp_path, {"models": [
        {"name": "a", "model": "nowhere", "memory_gb": 1}]})], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "models.0 (a): model path" in result.stderr and "/nowhere' does not exist" in result.stderr


def test_the_pool_command_reports_a_bad_config(tmp_path):
    result = subprocess.run([sys.executable, "-m", "shardserve", "pool", write_config(tmp_path, {"models": []})],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "shardserve pool: error:" in result.stderr and "models: List should have at least 1 item" in result.stderr


def test_ctrl_c_stops_a_pool_of_two_rank_models_quietly(tiny_model_dir, tmp_path):
    """Ctrl-C reaches the pool, its models and their ranks at once (one process group): every process stops
    in order, the stream in flight ends with the 'shutting down' error, and no ERROR or traceback is logged."""
    import os
    import signal
    import tempfile
    import time

    from shardserve.distributed.process_group import find_free_port
    from tests.serving import stream_in_background, wait_until_healthy

    config = write_config(tmp_path, {"models": [{"name": "llama", "model": tiny_model_dir("llama-untied"),
                                                 "memory_gb": 1, "tensor_parallel_size": 2,
                                                 "args": ["--kv-cache-memory", "0.05"]}]})
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        pool = subprocess.Popen([sys.executable, "-m", "shardserve", "pool", config, "--port", str(port), "--device",
                                 "cpu"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_until_healthy(url, [pool], 180, lambda: (log.seek(0), log.read())[1])
            reader, events, started = stream_in_background(
                url, {"model": "llama", "prompt": "w1 w2", "max_tokens": 480, "ignore_eos": True})
            assert started.wait(60), "the stream never started"
            time.sleep(0.2)
            os.killpg(pool.pid, signal.SIGINT)
            code = pool.wait(timeout=90)
            reader.join(timeout=30)
        finally:
            if pool.poll() is None:
                os.killpg(pool.pid, signal.SIGKILL)
        log.seek(0)
        output = log.read()
    assert code == 0, output
    assert "Traceback" not in output and " ERROR " not in output, output
    assert any("shutting down" in e for e in events), events[-3:]
