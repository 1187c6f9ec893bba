"""The front end's engine client (requests/client.py) for an engine core in another process.

It sends token ids and sampling parameters to the core and turns the token outputs that come back into
RequestOutputs with their text: detokenization and stop strings happen here, in the front end (a request
that meets a stop string is finished here and aborted in the core). One task reads the core's channel and
hands each output to its request's collector (requests/output_collector.py); health, sleep state and statistics are the core's latest Status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from shardserve.ipc.core_server import input_address, output_address
from shardserve.ipc.messages import (
    Abort,
    AddRequest,
    Call,
    CallReply,
    Failure,
    Outputs,
    Status,
    ToFrontend,
    TokenOutput,
)
from shardserve.requests.client import EngineDeadError, EngineStats, ServerShuttingDown
from shardserve.requests.commands import EngineCall, Sleep, WakeUp
from shardserve.requests.detokenizer import detokenizer_for, text_update
from shardserve.requests.output_collector import OutputCollector
from shardserve.requests.outputs import RequestOutput
from shardserve.requests.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shardserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The core sends its status every 0.25 s: after this long without one, it counts as gone.
STATUS_STALE_S = 5.0


def _exception(kind: str, message: str) -> BaseException:
    if kind == "invalid":
        return ValueError(message)
    if kind == "shutting_down":
        return ServerShuttingDown(message)
    if kind == "dead":
        return EngineDeadError(message)
    return RuntimeError(message)


class _Request:
    """One request's state in the front end: its tokens so far, its text, where its outputs go."""

    __slots__ = ("request_id", "prompt_token_ids", "params", "token_ids", "detokenizer", "outputs", "done")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: "Tokenizer") -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.token_ids: list[int] = []
        self.detokenizer = detokenizer_for(tokenizer, params) if params.detokenize else None
        self.outputs = OutputCollector()
        self.done = False  # finished here (the core's last output, or a stop string)

    def output(self, item: TokenOutput) -> tuple[RequestOutput, bool]:
        """The RequestOutput for one of the core's outputs, and whether a stop string ended the request here."""
        self.token_ids.extend(item.new_token_ids)
        finished, reason = item.finished, item.finish_reason
        delta, stopped = "", False
        if self.detokenizer is not None:
            delta, stopped = text_update(self.detokenizer, self.token_ids, reason if finished else None)
        if stopped:
            finished, reason = True, "stop"
        self.done = finished
        text = self.detokenizer.text if self.detokenizer is not None else ""
        return RequestOutput(self.request_id, self.prompt_token_ids, self.token_ids, text, item.new_token_ids,
                             delta, item.new_logprobs, finished, reason), stopped and not item.finished


class CoreClient:
    """An EngineClient whose engine runs in the engine core process (ipc/core_server.py)."""

    def __init__(self, ipc_dir: str, frontend: int, tokenizer: "Tokenizer") -> None:
        self.tokenizer = tokenizer
        self.frontend = frontend
        self.max_model_len = 0  # from the core's first status
        self._ipc_dir = ipc_dir
        self._requests: dict[str, _Request] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._status: Status | None = None
        self._status_at = 0.0
        self._closing: str | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToFrontend)
        self._context: zmq.asyncio.Context | None = None
        self._reader: asyncio.Task | None = None

    # -- lifetime (inside the server's event loop) -------------------------------------------------
    async def start(self, is_abandoned: Callable[[], str | None] = lambda: None) -> None:
        """Connect to the core and wait for its first status (sent once the engine is built: loading a model
        takes as long as it takes); `is_abandoned` says why to give up waiting (rank 0's process is gone)."""
        self._context = zmq.asyncio.Context()
        self._send_socket = self._context.socket(zmq.PUSH)
        self._send_socket.setsockopt(zmq.LINGER, 0)
        self._send_socket.connect(input_address(self._ipc_dir))
        self._receive_socket = self._context.socket(zmq.PULL)
        self._receive_socket.connect(output_address(self._ipc_dir, self.frontend))
        self._reader = asyncio.create_task(self._read(), name="shardserve-core-reader")
        while self._status is None:
            reason = is_abandoned()
            if reason is not None:
                raise RuntimeError(f"front end {self.frontend} stops waiting for the engine core: {reason}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)

    # -- the EngineClient interface ----------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._closing is not None:
            raise ServerShuttingDown(self._closing)
        if not self.is_healthy():
            raise EngineDeadError(self._why_unhealthy())
        request = _Request(request_id, prompt_token_ids, params, self.tokenizer)
        self._requests[request_id] = request
        # The core only computes tokens: text, and so stop strings, stay here.
        core_params = dataclasses.replace(params, stop=(), detokenize=False)
        await self._send(AddRequest(self.frontend, request_id, prompt_token_ids, core_params))
        try:
            while True:
                item = await request.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._requests.pop(request_id, None)
            if not request.done:
                await self._send(Abort([request_id]))

    async def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            request.done = True
        await self._send(Abort([request_id]))

    def is_healthy(self) -> bool:
        return self._fresh() and self._status.healthy

    def health_details(self) -> dict:
        if not self._fresh():
            return {"last_failure": self._why_unhealthy()}
        return dict(self._status.details)

    @property
    def is_sleeping(self) -> bool:
        return self._status is not None and self._status.sleeping

    async def sleep(self, level: int) -> None:
        await self._call(Sleep(level))

    async def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        await self._call(WakeUp(weights, kv_cache))

    def stats(self) -> EngineStats:
        if self._status is None or self._status.stats is None:
            raise AttributeError("the engine core has sent no statistics yet")
        return self._status.stats

    def stop_accepting(self, reason: str) -> None:
        self._closing = reason
        for request in list(self._requests.values()):
            request.outputs.put(ServerShuttingDown(reason))

    def shutdown(self) -> None:
        pass  # the sockets close with the event loop (stop)

    # -- internals ---------------------------------------------------------------------------------
    def _fresh(self) -> bool:
        return self._status is not None and time.monotonic() - self._status_at < STATUS_STALE_S

    def _why_unhealthy(self) -> str:
        if self._status is None:
            return "the engine core has not started"
        if not self._fresh():
            return f"the engine core has sent nothing for {time.monotonic() - self._status_at:.0f} s"
        return self._status.details.get("last_failure") or "the engine is not running"

    async def _send(self, message) -> None:
        await self._send_socket.send(self._encoder.encode(message), copy=False)

    async def _call(self, command: EngineCall) -> None:
        call_id = next(self._call_ids)
        done = asyncio.get_running_loop().create_future()
        self._calls[call_id] = done
        try:
            await self._send(Call(self.frontend, call_id, command))
            await done
        finally:
            self._calls.pop(call_id, None)

    async def _read(self) -> None:
        watch = asyncio.create_task(self._watch_core())
        try:
            while True:
                data = await self._receive_socket.recv(copy=False)
                try:
                    self._dispatch(self._decoder.decode(data.buffer))
                except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                    logger.exception("front end %d: a message from the engine core failed", self.frontend)
        finally:
            watch.cancel()

    def _dispatch(self, message) -> None:
        if isinstance(message, Outputs):
            stopped = []
            for item in message.items:
                request = self._requests.get(item.request_id)
                if request is None or request.done:
                    continue  # aborted here, or ended by a stop string; the core drops it soon
                output, stopped_here = request.output(item)
                request.outputs.put(output)
                if stopped_here:
                    stopped.append(item.request_id)
            if stopped:
                asyncio.ensure_future(self._send(Abort(stopped)))
        elif isinstance(message, Status):
            self._status, self._status_at = message, time.monotonic()
            self.max_model_len = message.max_model_len
        elif isinstance(message, Failure):
            request = self._requests.get(message.request_id)
            if request is not None:
                request.done = True
                request.outputs.put(_exception(message.kind, message.message))
        elif isinstance(message, CallReply):
            done = self._calls.get(message.call_id)
            if done is not None and not done.done():
                if message.failure_kind is None:
                    done.set_result(None)
                else:
                    done.set_exception(_exception(message.failure_kind, message.message))

    async def _watch_core(self) -> None:
        """Fail the requests in flight once the core has gone quiet: they would never end otherwise."""
        while True:
            await asyncio.sleep(1.0)
            if self._fresh():
                continue
            reason = self._why_unhealthy()
            for request in list(self._requests.values()):
                if not request.done:
                    request.done = True
                    request.outputs.put(EngineDeadError(reason))
            for done in self._calls.values():
                if not done.done():
                    done.set_exception(EngineDeadError(reason))
