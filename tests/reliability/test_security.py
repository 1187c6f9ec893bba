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
from tests.reliability.fuzz import openai_error_problem
from tests.reliability.servers import EDGE_API_KEY

PUBLIC = {("GET", "/health"), ("GET", "/version")}
# FastAPI's own pages, and a path no route has: refused without the key like everything else.
EXTRA_PATHS = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/no/such/path"),
               ("POST", "/v1/embeddings")]


def _endpoints(edge_http: httpx.Client) -> list[tuple[str, str]]:
    schema = edge_http.get("/openapi.json").json()
    return [(method.upper(), path) for path, item in schema["paths"].items() for method in item] + EXTRA_PATHS


def test_every_endpoint_but_health_and_version_needs_the_key(edge_server: str, edge_http: httpx.Client) -> None:
    endpoints = _endpoints(edge_http)
    assert ("GET", "/metrics") in endpoints and ("POST", "/v1/chat/completions") in endpoints
    for key in (None, "sk-wrong", EDGE_API_KEY.upper()):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=edge_server, headers=headers, timeout=30) as http:
            for method, path in endpoints:
                response = http.request(method, path, json={"prompt": "w10", "max_tokens": 1})
                if (method, path) in PUBLIC:
                    assert response.status_code == 200, (method, path)
                    continue
                assert response.status_code == 401, (key, method, path, response.status_code)
                assert openai_error_problem(response) is None, response.text
                assert "API key" in response.json()["error"]["message"]
                assert response.headers["www-authenticate"] == "Bearer"
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
