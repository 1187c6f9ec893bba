"""The reliability checks share two real servers (tests/reliability/servers.py), started once for the package."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.servers import (
    EDGE_API_KEY,
    MODEL_SPEC,
    edge_server_args,
    load_server_args,
    running,
)


@pytest.fixture(scope="package")
def load_server(tiny_model_dir) -> Iterator[str]:
    """URL of a two-rank server with a small KV cache, for load and disconnects."""
    with running(load_server_args(tiny_model_dir(MODEL_SPEC))) as url:
        yield url


@pytest.fixture(scope="package")
def edge_server(tiny_model_dir) -> Iterator[str]:
    """URL of a one-rank server with an API key, a 1 MiB body limit and a 64-token context."""
    with running(edge_server_args(tiny_model_dir(MODEL_SPEC))) as url:
        yield url


@pytest.fixture
def edge_http(edge_server: str) -> Iterator[httpx.Client]:
    """A client of the edge server that sends its API key."""
    with httpx.Client(base_url=edge_server, headers={"Authorization": f"Bearer {EDGE_API_KEY}"},
                      timeout=60) as client:
        yield client
