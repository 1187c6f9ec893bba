"""Step plans from rank 0 to the other ranks over one TCP connection each, instead of gloo broadcasts.

A gloo broadcast hands its tensor to the process group's worker thread and waits for it, and a plan took two
(its size, then its bytes): 0.4-0.7 ms of rank 0's host time every step on the machines measured
(docs/benchmarks-notebook.md), on the thread that schedules the next step. Written to a socket, a plan costs
rank 0 tens of microseconds, and the other ranks block in `recv` until it arrives.

Set-up is a collective over the gloo control group, taken at the same point on every rank (the control plane's
construction): rank 0 listens on the host the ranks met at (the rendezvous address, which every rank already
reached), every other rank connects and proves that it holds the launch's control key, rank 0 answers in kind
(so a rank never takes plans from a stranger on that port), and the ranks agree by an all-gather that every
connection stands. If any rank could not connect (rank 0's rendezvous address is not one of its own, a
firewall), every rank keeps the gloo broadcasts, and rank 0 logs why.

What flows is exactly the gloo path's message: the header (message number, payload bytes) then the payload and
its MAC; control_plane.py checks both the same way whichever way they came. A connection that closes before the
shutdown plan, or stays silent for the collective timeout (rank 0 sends keep-alive plans when idle), is an
error naming the rank at the other end, never a silent wait.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import time
from typing import Callable

import torch.distributed as dist

from shardserve.distributed.control_plane import all_gather_msgpack
from shardserve.distributed.control_token import MAC_BYTES, mac
from shardserve.distributed.lockstep import LockstepError
from shardserve import envs

__all__ = ["PlanStreams", "PlanConnectionLost", "TRANSPORT_ENV", "open_plan_streams"]

logger = logging.getLogger(__name__)

TRANSPORT_ENV = envs.PLAN_TRANSPORT.name  # tcp (default): this module where every rank connects; gloo: never
CONNECT_TIMEOUT_S = 10.0  # set-up: one rank connecting, or rank 0 waiting for all of them


class PlanConnectionLost(LockstepError):
    """The connection a step plan travels on closed or went silent: the rank at its other end stopped."""


class PlanStreams:
    """Rank 0: a connected socket to every other rank, in rank order. Any other rank: its socket to rank 0."""

    def __init__(self, rank: int, peers: dict[int, socket.socket], timeout_s: float,
                 describe: Callable[[int], str] = "rank {}".format) -> None:
        """describe: how errors name a peer rank (RankContext.describe_rank: with pipeline stages, its stage)."""
        self.rank = rank
        self.peers = peers
        self.describe = describe
        for sock in peers.values():
            sock.settimeout(timeout_s)

    def send(self, message: bytes) -> None:
        for peer, sock in self.peers.items():
            try:
                sock.sendall(message)
            except OSError as e:  # a reset, a broken pipe, or the peer not reading for the whole timeout
                raise PlanConnectionLost(f"rank {self.rank}: the plan connection to {self.describe(peer)} failed "
                                         f"({type(e).__name__}: {e}): that rank has stopped") from e

    def receive(self, size: int) -> bytearray:
        """Exactly `size` bytes from rank 0."""
        sock = self.peers[0]
        try:
            return _recv_exactly(sock, size)
        except EOFError:
            raise PlanConnectionLost(f"rank {self.rank}: rank 0 closed the plan connection before the shutdown "
                                     f"plan: rank 0 has stopped") from None
        except TimeoutError as e:
            raise PlanConnectionLost(f"rank {self.rank}: no step message from rank 0 for {sock.gettimeout():.0f} s "
                                     f"(it sends keep-alive plans when idle): rank 0 is stuck or gone") from e
        except OSError as e:
            raise PlanConnectionLost(f"rank {self.rank}: the plan connection to rank 0 failed "
                                     f"({type(e).__name__}: {e}): rank 0 has stopped") from e

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers = {}


def open_plan_streams(group: dist.ProcessGroup, rank: int, world_size: int, key: bytes, host: str | None,
                      timeout_s: float, describe: Callable[[int], str] = "rank {}".format) -> PlanStreams | None:
    """Connect rank 0 to every other rank at `host` (rank 0's rendezvous address), or None on every rank where
    any rank could not (or $SHARDSERVE_PLAN_TRANSPORT=gloo). A collective over `group`: every rank calls it."""
    if envs.PLAN_TRANSPORT.get() == "gloo" or host is None:
        return None
    listener, offer = None, {}
    if rank == 0:
        try:
            listener = _listen(host)
            offer = {"port": listener.getsockname()[1], "nonce": secrets.token_bytes(16)}
        except OSError as e:
            offer = {"error": f"rank 0 cannot listen on {host} ({type(e).__name__}: {e})"}
    offer = all_gather_msgpack(offer, group, world_size)[0]
    peers: dict[int, socket.socket] = {}
    why = offer.get("error", "")
    if not why:
        try:
            if rank == 0:
                peers = _accept_ranks(listener, world_size, key, offer["nonce"])
            else:
                peers = {0: _connect_to_rank0(host, offer["port"], rank, key, offer["nonce"])}
        except (OSError, _Refused) as e:
            why = f"rank {rank}: {type(e).__name__}: {e}" if isinstance(e, OSError) else f"rank {rank}: {e}"
    if listener is not None:
        listener.close()
    outcomes = all_gather_msgpack(why, group, world_size)
    failed = [w for w in outcomes if w]
    if failed:
        for sock in peers.values():
            sock.close()
        if rank == 0:
            logger.warning("step plans go by gloo broadcasts: the ranks could not all connect to rank 0 at %s (%s)",
                           host, "; ".join(failed))
        return None
    if rank == 0:
        logger.info("step plans go to %d rank(s) over TCP connections to %s", world_size - 1, host)
    return PlanStreams(rank, peers, timeout_s, describe)


class _Refused(Exception):
    """A connection that did not prove it comes from a rank of this launch."""


def _hello(key: bytes, nonce: bytes, rank: int) -> bytes:
    return mac(key, "plan stream: a rank connects", nonce, rank)


def _welcome(key: bytes, nonce: bytes, rank: int) -> bytes:
    return mac(key, "plan stream: rank 0 accepts", nonce, rank)


def _listen(host: str) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind(address[:2])
        listener.listen(64)
    except OSError:
        listener.close()
        raise
    return listener


def _accept_ranks(listener: socket.socket, world_size: int, key: bytes, nonce: bytes) -> dict[int, socket.socket]:
    """Rank 0: one authenticated connection from each other rank, before the deadline. Connections that do not
    prove the control key are closed and ignored (the port is open to the rendezvous network)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < world_size - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                missing = sorted(set(range(1, world_size)) - set(peers))
                raise _Refused(f"rank(s) {missing} did not connect within {CONNECT_TIMEOUT_S:.0f} s") from None
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                claim = _read_greeting(sock, 8 + MAC_BYTES)
                peer = int.from_bytes(claim[:8], "little")
                if not 0 < peer < world_size or peer in peers or not hmac.compare_digest(
                        claim[8:], _hello(key, nonce, peer)):
                    raise _Refused("not a rank of this launch")
                sock.sendall(_welcome(key, nonce, peer))
            except (OSError, _Refused) as e:
                logger.warning("plan stream: refused a connection from %s (%s)", _address(sock), e)
                sock.close()
                continue
            _no_delay(sock)
            peers[peer] = sock
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    return dict(sorted(peers.items()))


def _connect_to_rank0(host: str, port: int, rank: int, key: bytes, nonce: bytes) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    try:
        sock.sendall(rank.to_bytes(8, "little") + _hello(key, nonce, rank))
        if not hmac.compare_digest(_read_greeting(sock, MAC_BYTES), _welcome(key, nonce, rank)):
            raise _Refused(f"the listener at {host}:{port} is not rank 0 of this launch")
    except BaseException:
        sock.close()
        raise
    _no_delay(sock)
    return sock


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    """Exactly `size` bytes from `sock`: EOFError where the other end closes first (socket errors and timeouts
    propagate)."""
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError
        got += n
    return data


def _read_greeting(sock: socket.socket, size: int) -> bytearray:
    try:
        return _recv_exactly(sock, size)
    except EOFError:
        raise _Refused("the connection closed during the greeting") from None


def _no_delay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _address(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername())
    except OSError:
        return "an unknown address"


def rendezvous_host(init_method: str) -> str | None:
    """The host of rank 0's rendezvous address: every rank reached it to join, so rank 0 listens there."""
    if init_method.startswith("tcp://"):
        host = init_method[len("tcp://"):].rsplit(":", 1)[0]
    elif init_method.startswith("env://"):
        host = os.environ.get("MASTER_ADDR", "")
    else:
        return None
    return host.strip("[]") or None
