"""find_free_port: a port free to listen on, taken below the kernel's range for outgoing connections, where a
connection another process opens before the server binds cannot take it."""

from __future__ import annotations

import socket

import pytest

from shardserve.distributed import process_group
from shardserve.distributed.process_group import LOWEST_LISTEN_PORT, find_free_port


def test_the_port_is_free_and_below_the_range_of_outgoing_connections():
    start = process_group._ephemeral_start()
    if start is None or start <= LOWEST_LISTEN_PORT:
        pytest.skip("no Linux ephemeral port range with room below it here")
    ports = {find_free_port() for _ in range(20)}
    assert all(LOWEST_LISTEN_PORT <= p < start for p in ports)
    assert len(ports) > 1  # drawn at random, not the same port for every caller
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_ports_in_use_are_skipped_and_without_the_range_the_kernel_picks(monkeypatch):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        monkeypatch.setattr(process_group, "_ephemeral_start", lambda: None)
        assert find_free_port() != port
        monkeypatch.setattr(process_group, "LOWEST_LISTEN_PORT", port)  # the only candidate below: taken
        monkeypatch.setattr(process_group, "_ephemeral_start", lambda: port + 1)
        assert find_free_port() != port
    finally:
        taken.close()
