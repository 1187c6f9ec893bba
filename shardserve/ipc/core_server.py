"""The engine core's end of the front-end channel, in the process of rank 0.

A receiver thread takes the front ends' messages (requests, aborts, sleep and wake calls) and hands them to
the engine loop (an AsyncEngine, or the Supervisor that restarts one); the engine thread puts each output in
its front end's outbox and `flush` sends every outbox as one message after each step. Status messages go to
every front end every STATUS_INTERVAL_S and right after a call, so that all of them see one state.

Invariants: the server knows which front end owns each request in flight (`_owner`), so a front end that dies
has its requests aborted (`forget_frontend`); every send happens under `_send_lock` (the engine thread, the
receiver thread and the supervisor's thread all send, and a ZeroMQ socket must not be used by two at once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from shardserve.ipc.messages import (
    STATUS_INTERVAL_S,
    Abort,
    AddRequest,
    Call,
    CallReply,
    Failure,
    Outputs,
    Status,
    ToCore,
    TokenOutput,
)
from shardserve.requests.client import EngineDeadError, ServerShuttingDown

if TYPE_CHECKING:
    from shardserve.requests.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Messages kept for a front end that does not read (one that is starting or has died); beyond it they are dropped.
_SEND_HIGH_WATER_MARK = 100_000


def input_address(ipc_dir: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, 'to-core')}"


def output_address(ipc_dir: str, frontend: int) -> str:
    return f"ipc://{os.path.join(ipc_dir, f'to-frontend-{frontend}')}"


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, ServerShuttingDown):
        return "shutting_down"
    if isinstance(exc, EngineDeadError):
        return "dead"
    if isinstance(exc, ValueError):
        return "invalid"
    return "error"


class _RemoteStream:
    """One request's stream: outputs wait in the owning front end's outbox until the step's flush."""

    __slots__ = ("server", "frontend", "request_id")

    def __init__(self, server: "EngineCoreServer", frontend: int, request_id: str) -> None:
        self.server = server
        self.frontend = frontend
        self.request_id = request_id

    def put(self, item: "RequestOutput | BaseException") -> None:
        if isinstance(item, BaseException):
            self.server.send_failure(self.frontend, self.request_id, item)
            return
        self.server.outboxes[self.frontend].append(TokenOutput(
            item.request_id, item.new_token_ids, item.new_logprobs, item.finished, item.finish_reason))
        if item.finished:
            self.server.owner.pop(item.request_id, None)


class EngineCoreServer:
    def __init__(self, ipc_dir: str, num_frontends: int) -> None:
        self.engine = None  # attached once built (an AsyncEngine or a Supervisor)
        self.max_model_len = 0
        self.outboxes: list[list[TokenOutput]] = [[] for _ in range(num_frontends)]
        self.owner: dict[str, int] = {}  # request id -> the front end that sent it
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PULL)
        self._input.bind(input_address(ipc_dir))
        self._outputs = []
        for i in range(num_frontends):
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, _SEND_HIGH_WATER_MARK)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(output_address(ipc_dir, i))
            self._outputs.append(sock)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCore)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, engine) -> None:
        """Start serving the front ends from `engine`."""
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self._thread = threading.Thread(target=self._receive, name="shardserve-core-server", daemon=True)
        self._thread.start()

    # -- sending (any thread) ----------------------------------------------------------------------
    def flush(self) -> None:
        """Send each front end the outputs waiting for it, as one message (on the engine thread, after a step)."""
        for frontend, box in enumerate(self.outboxes):
            if box:
                self.outboxes[frontend] = []
                self._send(frontend, Outputs(box))

    def send_failure(self, frontend: int, request_id: str, exc: BaseException) -> None:
        self.owner.pop(request_id, None)
        self._send(frontend, Failure(request_id, failure_kind(exc), str(exc)))

    def send_status(self) -> None:
        engine = self.engine
        try:
            stats = engine.stats()
        except AttributeError:  # no engine yet, or none any more (a restart in progress)
            stats = None
        status = Status(engine.is_healthy(), engine.health_details(), engine.is_sleeping, stats,
                        self.max_model_len)
        for frontend in range(len(self._outputs)):
            self._send(frontend, status)

    def _send(self, frontend: int, message) -> None:
        data = self._encoder.encode(message)
        with self._send_lock:
            try:
                self._outputs[frontend].send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # nobody reads this front end's channel (starting, or dead)
                pass

    # -- receiving (the receiver thread) -----------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._input, zmq.POLLIN)
        next_status = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_status:
                self._safely(self.send_status)
                next_status = now + STATUS_INTERVAL_S
            if not poller.poll(timeout=max(1, int((next_status - now) * 1000))):
                continue
            while True:
                try:
                    data = self._input.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    message = self._decoder.decode(data.buffer)
                except msgspec.DecodeError:
                    logger.exception("a front end sent a message that does not decode; ignored")
                    continue
                self._safely(self._handle, message)

    def _safely(self, action, *args) -> None:
        try:
            action(*args)
        except Exception:  # noqa: BLE001 - one bad message must not stop the channel
            logger.exception("engine core server: %s failed", getattr(action, "__name__", action))

    def _handle(self, message) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, Abort):
            for request_id in message.request_ids:
                self.owner.pop(request_id, None)
                self.engine.abort_soon(request_id)
        elif isinstance(message, Call):
            self._call(message)

    def _add(self, message: AddRequest) -> None:
        rid, frontend = message.request_id, message.frontend
        try:
            self.owner[rid] = frontend
            self.engine.submit(rid, message.prompt_token_ids, message.params, _RemoteStream(self, frontend, rid))
        except Exception as e:  # noqa: BLE001 - refused: the front end hears why
            self.send_failure(frontend, rid, e)

    def _call(self, message: Call) -> None:
        def reply(future) -> None:
            error = future.exception()
            # The new sleep state goes to every front end before the caller hears that the call is done.
            self._safely(self.send_status)
            self._send(message.frontend, CallReply(message.call_id, None if error is None else failure_kind(error),
                                                   "" if error is None else str(error)))

        try:
            self.engine.call(message.command).add_done_callback(reply)
        except Exception as e:  # noqa: BLE001 - the caller hears why
            self._send(message.frontend, CallReply(message.call_id, failure_kind(e), str(e)))

    # -- front ends and shutdown -------------------------------------------------------------------
    def forget_frontend(self, frontend: int) -> None:
        """A front end died: abort the requests it had sent (nobody will read their outputs)."""
        lost = [rid for rid, owner in list(self.owner.items()) if owner == frontend]
        for rid in lost:
            self.owner.pop(rid, None)
            self.engine.abort_soon(rid)
        if lost:
            logger.warning("front end %d stopped with %d requests in flight: aborted them", frontend, len(lost))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._send_lock:
            self._context.destroy(linger=0)
