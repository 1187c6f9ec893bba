"""`shardserve pool --api-key`: every endpoint but /health refuses a request without the key, as
`shardserve serve --api-key` does, and the models behind the pool refuse requests that skip it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from shardserve.cli import parse_args
from shardserve.pool.config import PoolConfigError, load_pool_config
from tests.pool.running import running_pool, write_config

MODEL = "llama"
FILE_KEY = "sk-pool-file"
FLAG_KEY = "sk-pool-flag"


@pytest.fixture(scope="module")
def pool(tiny_model_dir, tmp_path_factory):
    """One model behind a pool whose config says FILE_KEY and whose command line says FLAG_KEY."""
    config = {"api_key": FILE_KEY, "models": [
        {"name": MODEL, "model": tiny_model_dir("llama-untied"), "memory_gb": 1, "args": ["--kv-cache-memory", "0.05"]}]}
    with running_pool(write_config(tmp_path_factory.mktemp("pool-auth"), config), "--api-key", FLAG_KEY) as running:
        yield running


def error_of(response: httpx.Response) -> dict:
    """The OpenAI-style `error` object of a 401, after checking the status and the shape."""
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {FLAG_KEY}"}])
def test_requests_without_the_key_are_refused(pool, headers):
    with httpx.Client(base_url=pool.url, headers=headers, timeout=30) as http:
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/nowhere")]:
            error = error_of(http.request(method, path, json={"model": MODEL, "prompt": "w1"}))
            assert "Missing API key" in error["message"], (method, path)


def test_a_wrong_key_is_refused_and_the_flag_wins_over_the_config(pool):
    for key in ("sk-wrong", FILE_KEY):
        client = openai.OpenAI(base_url=f"{pool.url}/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model=MODEL, prompt="w1", max_tokens=2)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key" and key not in info.value.body["message"]


def test_the_right_key_is_served(pool):
    client = openai.OpenAI(base_url=f"{pool.url}/v1", api_key=FLAG_KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.model == MODEL and completion.usage.completion_tokens == 4
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], max_tokens=3,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_health_needs_no_key(pool):
    response = httpx.get(f"{pool.url}/health", timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_the_models_behind_the_pool_refuse_requests_that_skip_it(pool):
    members = _member_argvs(pool.process.pid)
    assert len(members) == 1
    assert not any(a.startswith("--api") for a in members[0]), "the models' key must not be on a command line"
    ports = [int(argv[argv.index("--port") + 1]) for argv in members]
    for key in (None, FLAG_KEY, FILE_KEY):  # the pool's own keys do not open its models either
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in [("POST", "/v1/completions"), ("POST", "/sleep")]:
            response = httpx.request(method, f"http://127.0.0.1:{ports[0]}{path}", headers=headers, timeout=30,
                                     json={"model": MODEL, "prompt": "w1"})
            assert response.status_code == 401, (key, path)
    awake = {m["id"]: m["state"] for m in httpx.get(f"{pool.url}/v1/models", headers={
        "Authorization": f"Bearer {FLAG_KEY}"}, timeout=30).json()["data"]}
    assert awake == {MODEL: "awake"}


def test_config_api_key_must_be_sendable(tmp_path):
    models = [{"name": "a", "model": "/m", "memory_gb": 1}]
    assert load_pool_config(write_config(tmp_path, {"api_key": "sk-1", "models": models})).api_key == "sk-1"
    assert "sk-1" not in repr(load_pool_config(write_config(tmp_path, {"api_key": "sk-1", "models": models})))
    for bad in ("", " sk-1"):
        with pytest.raises(PoolConfigError, match="api_key: Value error, the API key must not be empty"):
            load_pool_config(write_config(tmp_path, {"api_key": bad, "models": models}))
    with pytest.raises(PoolConfigError, match=r"models\.0\.args: Value error, --api-key are set by the pool"):
        load_pool_config(write_config(tmp_path, {"models": [{**models[0], "args": ["--api-key", "k"]}]}))
    # --flag=value, and abbreviations (which serve refuses anyway), are the pool's flags too
    for args, named in ((["--api-key=k"], "--api-key"), (["--api", "k"], r"--api \(--api-key\)"),
                        (["--po", "1"], r"--po \(--port\)")):
        with pytest.raises(PoolConfigError, match=rf"models\.0\.args: Value error, {named} are set by the pool"):
            load_pool_config(write_config(tmp_path, {"models": [{**models[0], "args": args}]}))
    assert load_pool_config(write_config(tmp_path, {"models": [{**models[0], "args": ["--max-num-seqs", "4"]}]}))


def test_the_api_key_flag_must_be_sendable(capsys):
    assert parse_args(["pool", "pool.yaml", "--api-key", "sk-1"]).api_key == "sk-1"
    with pytest.raises(SystemExit):
        parse_args(["pool", "pool.yaml", "--api-key", ""])
    assert "argument --api-key: the API key must not be empty" in capsys.readouterr().err


def _member_argvs(pool_pid: int) -> list[list[str]]:
    """The command line of each `shardserve serve` the pool started (Linux: read from /proc)."""
    children = Path(f"/proc/{pool_pid}/task/{pool_pid}/children")
    if not children.exists():
        pytest.skip("this system does not list a process's children in /proc")
    argvs = [Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") for pid in children.read_text().split()]
    return [argv for argv in argvs if "serve" in argv and "--port" in argv]
