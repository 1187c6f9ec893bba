"""Step plans over TCP connections from rank 0 (distributed/plan_stream.py): every rank gets every plan, in
order, large ones too; ranks fall back to gloo together where a connection cannot be made; a rank whose rank 0
dies learns it at once, by name, instead of waiting; a connection without the launch's key is refused."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from shardserve.distributed import plan_stream
from shardserve.distributed.control_token import control_key
from tests.ranks import run_ranks

TOKEN = "plan-stream-test"


def _plans():
    from shardserve.wire.step_plan import FROM_DEVICE, PlanKind, SeqChunk, StepPlan

    plans = [StepPlan(step, PlanKind.RUN, [SeqChunk(s, 40 + step, [FROM_DEVICE], [s, 100 + step], True)
                                           for s in range(1 + step % 5)], tokens_from_device=True)
             for step in range(40)]
    # A prefill of 300,000 tokens: megabytes, far past what one socket buffer holds.
    plans.insert(20, StepPlan(20, PlanKind.RUN, [SeqChunk(99, 0, list(range(300_000)), list(range(19_000)), True)]))
    return plans + [StepPlan(41, PlanKind.SHUTDOWN)]


def _send_and_receive(rank: int, port: int, world_size: int, transport: str, host: str | None, results) -> None:
    import torch

    from shardserve.distributed.control_plane import ControlPlane
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context

    torch.set_num_threads(1)
    os.environ[plan_stream.TRANSPORT_ENV] = transport
    ctx = init_rank_context(rank, world_size, "cpu", f"tcp://127.0.0.1:{port}", control_token=TOKEN)
    try:
        if host is not None:
            ctx.rendezvous_host = host
        plane = ControlPlane.connect(ctx)
        plans = _plans()
        if rank == 0:
            for plan in plans:
                plane.send(plan)
            received_all = True
        else:
            received_all = [plane.receive() for _ in plans] == plans
        plane.close()
        results.put((rank, (plane.transport, received_all, plane.message_no)))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_receives_every_plan_in_order_over_tcp(world_size):
    outcome = run_ranks(_send_and_receive, world_size, world_size, "tcp", None)
    assert outcome == {rank: ("tcp", True, len(_plans())) for rank in range(world_size)}


def test_ranks_fall_back_to_gloo_together_where_rank_0_cannot_listen():
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: rank 0 cannot listen there, so no rank uses TCP.
    outcome = run_ranks(_send_and_receive, 2, 2, "tcp", "192.0.2.1")
    assert outcome == {0: ("gloo", True, len(_plans())), 1: ("gloo", True, len(_plans()))}


def test_gloo_broadcasts_when_asked():
    outcome = run_ranks(_send_and_receive, 2, 2, "gloo", None)
    assert outcome == {0: ("gloo", True, len(_plans())), 1: ("gloo", True, len(_plans()))}


def _rank_0_dies(rank: int, port: int, results) -> None:
    import torch

    from shardserve.distributed.control_plane import ControlPlane
    from shardserve.distributed.process_group import init_rank_context
    from shardserve.wire.step_plan import PlanKind, StepPlan

    torch.set_num_threads(1)
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", control_token=TOKEN)
    plane = ControlPlane.connect(ctx)
    if rank == 0:
        plane.send(StepPlan(1, PlanKind.KEEPALIVE))
        _put_and_flush(results, (0, "died"))
        time.sleep(0.5)
        os._exit(1)  # no shutdown plan, no teardown: as a crash
    started = time.monotonic()
    try:
        first = plane.receive().kind.name
        plane.receive()
        _put_and_flush(results, (1, f"received a second plan after {first}"))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        _put_and_flush(results, (1, (type(e).__name__, str(e), time.monotonic() - started)))
    os._exit(0)  # the group cannot tear down without rank 0


def _put_and_flush(results, item) -> None:
    """Put before os._exit, which would drop what the queue's feeder thread has not written yet."""
    results.put(item)
    results.close()
    results.join_thread()


def test_a_rank_learns_at_once_that_rank_0_died():
    outcome = run_ranks(_rank_0_dies, 2, timeout=60)
    assert outcome[0] == "died"
    kind, message, seconds = outcome[1]
    assert kind == "PlanConnectionLost"
    assert message == "rank 1: rank 0 closed the plan connection before the shutdown plan: rank 0 has stopped"
    assert seconds < 10  # the collective timeout is 120 s


def test_a_connection_without_the_launch_key_is_refused_and_the_rank_still_connects():
    key, nonce = control_key(TOKEN), b"n" * 16
    listener = plan_stream._listen("127.0.0.1")
    port = listener.getsockname()[1]
    answers = {}

    def stranger() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall((1).to_bytes(8, "little") + control_key("a guess")[:16])
            answers["stranger"] = sock.recv(64)  # closed without a welcome: b""

    def rank_1() -> None:
        time.sleep(0.2)  # after the stranger
        answers["rank 1"] = plan_stream._connect_to_rank0("127.0.0.1", port, 1, key, nonce)

    threads = [threading.Thread(target=stranger), threading.Thread(target=rank_1)]
    for t in threads:
        t.start()
    peers = plan_stream._accept_ranks(listener, 2, key, nonce)
    for t in threads:
        t.join(10)
    listener.close()
    assert answers["stranger"] == b""
    assert list(peers) == [1]
    streams = plan_stream.PlanStreams(0, peers, 5.0)
    streams.send(b"plan bytes")
    assert plan_stream.PlanStreams(1, {0: answers["rank 1"]}, 5.0).receive(10) == b"plan bytes"
    streams.close()
    answers["rank 1"].close()


def test_a_connection_to_a_listener_that_is_not_rank_0_is_refused():
    key, nonce = control_key(TOKEN), b"n" * 16
    impostor = plan_stream._listen("127.0.0.1")
    port = impostor.getsockname()[1]

    def answer_without_the_key() -> None:
        sock, _ = impostor.accept()
        with sock:
            sock.recv(64)
            sock.sendall(b"x" * 16)

    t = threading.Thread(target=answer_without_the_key)
    t.start()
    with pytest.raises(plan_stream._Refused, match=f"the listener at 127.0.0.1:{port} is not rank 0 of this launch"):
        plan_stream._connect_to_rank0("127.0.0.1", port, 1, key, nonce)
    t.join(10)
    impostor.close()


@pytest.mark.parametrize("init_method, env, host", [
    ("tcp://10.1.2.3:29500", {}, "10.1.2.3"),
    ("tcp://[::1]:29500", {}, "::1"),
    ("env://", {"MASTER_ADDR": "node7"}, "node7"),
    ("env://", {}, None),
    ("file:///tmp/rendezvous", {}, None),
])
def test_rank_0_listens_where_the_ranks_met(monkeypatch, init_method, env, host):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert plan_stream.rendezvous_host(init_method) == host


def test_an_unknown_transport_is_named_with_the_accepted_values(set_env):
    set_env({plan_stream.TRANSPORT_ENV: "udp"})
    with pytest.raises(ValueError, match="SHARDSERVE_PLAN_TRANSPORT='udp': expected one of tcp, gloo"):
        plan_stream.open_plan_streams(None, 0, 2, b"k", "127.0.0.1", 5.0)
