"""The engine loop: one thread steps the engine; callers hand it requests and get their outputs back.

Only the engine thread touches the engine (and so issues collectives); callers talk to it through a queue
of typed commands (requests/commands.py, which the engine core's channel carries too), and it answers each
request through that request's stream: an OutputCollector for callers in this process (`generate`), or any
object with `put` (`submit`: the engine core server batches a step's outputs per front end and sends them
once the step is done, from the `after_iteration` hook).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from shardserve.engine.llm_engine import LLMEngine
from shardserve.requests.client import EngineDeadError, EngineStats, ServerShuttingDown
from shardserve.requests.commands import Abort, Add, EngineCall, Sleep, WakeUp
from shardserve.requests.output_collector import OutputCollector
from shardserve.requests.outputs import RequestOutput
from shardserve.requests.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

KEEPALIVE_INTERVAL_S = 1.0
HEALTH_STALL_S = 8.0  # /health fails when the loop has not come round for this long while busy


class OutputStream(Protocol):
    """Where one request's outputs go, on the engine thread (errors may come from other threads)."""

    def put(self, item: RequestOutput | BaseException) -> None: ...


@dataclass
class _PendingCall:
    """A sleep or wake on its way to the engine thread; `done` settles when it has happened."""

    command: EngineCall
    done: concurrent.futures.Future


# What the command queue holds: None only wakes the loop (to see that it should stop).
_Command = Add | Abort | _PendingCall | None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    collector: OutputCollector

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.collector.put, item)


class AsyncEngine:
    """Builds the engine with `build_engine` on its own thread, then steps it there.

    The engine is built on the thread that steps it because CPU kernels run several times slower
    from a thread other than the one that prepared the weights (each thread gets its own OpenMP
    pool, and the idle pool competes for the cores).
    """

    def __init__(self, build_engine: Callable[[], LLMEngine],
                 after_iteration: Callable[[], None] | None = None) -> None:
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, OutputStream] = {}
        self._after_iteration = after_iteration  # on the engine thread, after each round of commands and step
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last_beat = time.monotonic()
        self._built = threading.Event()
        self._pending_sleeps: list[_PendingCall] = []
        self._deferred_adds: list[Add] = []
        self._closing: str | None = None  # why new and running requests are refused (the server stops)
        self._thread = threading.Thread(target=self._run, args=(build_engine,), name="shardserve-engine",
                                        daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len

    # -- caller side (any thread / event loop) -----------------------------------------------------
    def is_healthy(self) -> bool:
        return (self._thread.is_alive() and self._error is None
                and time.monotonic() - self._last_beat < HEALTH_STALL_S)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), OutputCollector())
        self.submit(request_id, prompt_token_ids, params, stream)
        finished = False
        try:
            while True:
                item = await stream.collector.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(Abort([request_id]))

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               stream: OutputStream) -> None:
        """Queue a request whose outputs go to `stream`; raises ValueError for a prompt the engine refuses,
        EngineDeadError (ServerShuttingDown) when it cannot run."""
        if self._closing is not None:
            raise ServerShuttingDown(self._closing)
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine has stopped: {self._error!r}")
        self.engine.validate_prompt(prompt_token_ids, params)
        self._streams[request_id] = stream
        self._commands.put(Add(request_id, prompt_token_ids, params))

    def abort_soon(self, request_id: str) -> None:
        """Abort a request (a no-op for one that already ended); its stream gets nothing more."""
        self._commands.put(Abort([request_id]))

    async def abort(self, request_id: str) -> None:
        self.abort_soon(request_id)

    def health_details(self) -> dict:
        return {}

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # -- sleep / wake (run on the engine thread; a sleep waits for the requests in flight) ----------
    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def sleep(self, level: int) -> None:
        await asyncio.wrap_future(self.call(Sleep(level)))

    async def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        await asyncio.wrap_future(self.call(WakeUp(weights, kv_cache)))

    def call(self, command: EngineCall) -> concurrent.futures.Future:
        """Run a Sleep or a WakeUp on the engine thread; the future settles when it is done (a sleep waits for
        the requests in flight)."""
        if not isinstance(command, (Sleep, WakeUp)):
            raise ValueError(f"unknown call {command!r}")
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine has stopped: {self._error!r}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_PendingCall(command, done))
        return done

    def stalled_for(self) -> float:
        """Seconds since the engine loop last came round (it does at least every KEEPALIVE_INTERVAL_S)."""
        return time.monotonic() - self._last_beat

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, or None while it runs."""
        if self._error is None and not self._thread.is_alive() and not self._stop.is_set():
            return EngineDeadError("the engine thread exited")
        return self._error

    def fail(self, reason: str) -> None:
        """Declare the engine dead from outside (a rank died): every waiting request ends with an error now,
        even while the engine thread is still blocked in a collective with the dead rank."""
        if self._error is None:
            self._error = EngineDeadError(reason)
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(reason))

    def stop_accepting(self, reason: str) -> None:
        """The server is stopping: end every request in flight with ServerShuttingDown (a 503) and refuse
        new ones; the engine aborts them as their streams close."""
        self._closing = reason
        for stream in list(self._streams.values()):
            stream.put(ServerShuttingDown(reason))

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=timeout)

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self, build_engine: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = build_engine()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor, which re-raises it
            self._error = e
            return
        finally:
            self._built.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._last_beat = time.monotonic()
                self._sleep_when_idle()
                if not self._drain_commands(block=not self.engine.has_work() and not self._pending_sleeps):
                    self.engine.keepalive()
                    continue
                if self.engine.has_work():
                    for out in self.engine.step():
                        self._deliver(out)
                if self._after_iteration is not None:
                    self._after_iteration()
            self.engine.shutdown()
        except BaseException as e:  # noqa: BLE001 - any failure must reach every waiting caller
            if self._stop.is_set() or self._closing is not None:
                # Stopping anyway: the other ranks may already be gone. Not a failure worth a traceback.
                logger.info("engine loop ended while the server stops (%s: %s)", type(e).__name__, e)
                return
            logger.exception("engine loop failed; failing all requests")
            self._error = e
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"the engine failed: {e}"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands. When blocking and nothing arrives in time, return False."""
        try:
            command = self._commands.get(timeout=KEEPALIVE_INTERVAL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return not block
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _sleep_when_idle(self) -> None:
        """Pending sleeps happen once no request is in flight; requests that came meanwhile then wait
        (held by the sleeping engine) for the wake."""
        if not self._pending_sleeps or self.engine.busy:
            return
        pending, self._pending_sleeps = self._pending_sleeps, []
        for call in pending:
            _settle(call.done, lambda level=call.command.level: self.engine.sleep(level))
        deferred, self._deferred_adds = self._deferred_adds, []
        for command in deferred:
            self._apply(command)

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _PendingCall):
            call = command.command
            if isinstance(call, Sleep):
                self._pending_sleeps.append(command)
            else:
                _settle(command.done, lambda: self.engine.wake_up(call.weights, call.kv_cache))
        elif isinstance(command, Add) and self._pending_sleeps:
            self._deferred_adds.append(command)
        elif isinstance(command, Add):
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
            except ValueError as e:
                stream = self._streams.pop(command.request_id, None)
                if stream is not None:
                    stream.put(e)
        elif isinstance(command, Abort):
            # A request added while a sleep was pending is still deferred here: drop it, or it would run
            # (and hold KV blocks) after its caller has gone.
            aborted = set(command.request_ids)
            self._deferred_adds = [add for add in self._deferred_adds if add.request_id not in aborted]
            for request_id in command.request_ids:
                self._streams.pop(request_id, None)
                self.engine.abort(request_id)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)


def _settle(done: concurrent.futures.Future, action: Callable[[], object]) -> None:
    """Run action on the engine thread and hand its outcome (or its error) to the waiting caller."""
    try:
        action()
    except Exception as e:  # noqa: BLE001 - the caller gets it
        done.set_exception(e)
    else:
        done.set_result(None)
