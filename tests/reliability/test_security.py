"""With --api-key, nothing but /health and /version answers without the key, and the key is compared in
constant time; the server binds 127.0.0.1 unless told otherwise. (The control plane between ranks:
tests/distributed/test_control_token.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from shardserve.entrypoints.openai import middleware
from tests.reliability.auth import PUBLIC, probe_auth
from tests.reliability.servers import EDGE_API_KEY


def test_every_endpoint_but_health_and_version_needs_the_key(edge_server: str, edge_http: httpx.Client) -> None:
    figures = probe_auth(edge_server, EDGE_API_KEY)
    assert {("GET", "/metrics"), ("POST", "/v1/chat/completions"), ("POST", "/sleep")} <= set(figures.endpoints)
    assert figures.let_in == []
    assert figures.public_open == 3 * len(PUBLIC), "/health or /version asked for the key"
    assert figures.refused == figures.asked - figures.public_open
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json")]:
        assert edge_http.request(method, path).status_code == 200, path


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    compare_digest = middleware.hmac.compare_digest

    def recording_compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", recording_compare_digest)

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"in"})

    async def ask(key: str) -> int:
        transport = httpx.ASGITransport(app=middleware.BearerAuth(app, "sk-right", public_paths=()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code

    assert asyncio.run(ask("sk-wrong")) == 401
    assert asyncio.run(ask("sk-right")) == 200
    assert compared == [(b"sk-wrong", b"sk-right"), (b"sk-right", b"sk-right")]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, local_port = local.rsplit(":", 1)
            if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_the_server_binds_loopback_unless_told_otherwise(edge_server: str) -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp")
    # The edge server is started without --host: 127.0.0.1, written little-endian in /proc.
    assert _listening_addresses(urlsplit(edge_server).port) == {"0100007F"}


def test_the_key_comes_from_the_flag_then_the_environment_then_the_pool_config(set_env):
    set_env({middleware.API_KEY_ENV: None})
    assert middleware.api_key_in_force(None) is None
    assert middleware.api_key_in_force(None, "from-config") == "from-config"
    set_env({middleware.API_KEY_ENV: "from-env"})
    assert middleware.api_key_in_force(None, "from-config") == "from-env"
    assert middleware.api_key_in_force("from-flag", "from-config") == "from-flag"
    set_env({middleware.API_KEY_ENV: ""})  # set but empty: as if unset
    assert middleware.api_key_in_force(None) is None
