"""One request's lifecycle with the engine and the client: submit, collect or stream, release.

`serve_choices` answers a request admitted by a route, as one JSON response or as
server-sent events, with the bodies a renderer (renderers.py) builds; each choice (n of each prompt) is
an engine request of its own.

Every request that reaches the engine is owned by a `_Generation`, whose `close()` runs on
every exit path (finished, failed, client gone), so an abandoned request never keeps its
KV-cache blocks: `serve_choices` closes it for plain JSON responses, `_EventStreamResponse`
for streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from shardserve.entrypoints.openai.errors import APIError, InvalidRequestError, ServerError, ServiceUnavailableError
from shardserve.entrypoints.openai.protocol import GenerationRequest
from shardserve.entrypoints.openai.protocol import UsageInfo
from shardserve.entrypoints.openai.renderers import Renderer
from shardserve.requests.client import ServerShuttingDown
from shardserve.requests.outputs import RequestOutput, TokenLogprob
from shardserve.requests.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shardserve.entrypoints.openai.metrics import RequestTimer
    from shardserve.requests.client import EngineClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Finish reasons a client may see; the engine's "abort" and "error" become error responses.
_CLIENT_FINISH_REASONS = frozenset({"stop", "length"})

# Status logged for requests whose client went away; nobody receives the response.
_CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class Choice:
    """One choice of a response: which of the request's prompts it continues, and how it samples."""

    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


async def serve_choices(
    raw_request: Request,
    engine: EngineClient,
    renderer: Renderer,
    choices: list[Choice],
    body: GenerationRequest,
    prompt_param: str = "prompt",
    keep: Callable[[list[tuple[RequestOutput, list[TokenLogprob]]]], list[int]] | None = None,
) -> Response:
    """Run each choice as its own engine request and answer as `body` asks: one JSON body with every choice,
    or one stream of events whose chunks name their choice's index.

    `prompt_param` is the request field an engine refusal of the prompt names ("prompt" or "messages"). `keep`
    (responses that are not streamed) picks the finished choices the response shows, in order (best_of); the
    usage counts them all.
    """
    metrics = getattr(raw_request.app.state, "metrics", None)
    generations: list[_Generation] | None = [
        _Generation(engine, renderer.request_id if i == 0 else f"{renderer.request_id}-{i}",
                    metrics.request() if metrics is not None else None)
        for i in range(len(choices))]
    try:
        await _unless_disconnected(raw_request, _start_all(generations, choices, prompt_param))
        if body.stream:
            events = _stream_events(generations, renderer, body.include_usage, choices)
            response = _EventStreamResponse(generations, events)
            generations = None  # the response owns them from here and closes them
            return response
        results = await _unless_disconnected(raw_request, asyncio.gather(*(_collect(g) for g in generations)))
        usage = _usage(choices, [final for final, _ in results])
        if keep is not None:
            results = [results[i] for i in keep(results)]
        return JSONResponse(renderer.response_choices(results, usage).model_dump(mode="json"))
    except _ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    finally:
        if generations is not None:
            for generation in generations:
                await generation.close()


async def _start_all(generations: list["_Generation"], choices: list[Choice], prompt_param: str) -> None:
    """Start every choice; the first failure is raised once all have started or failed (the caller closes
    them all either way).

    The first choice of each prompt starts first: once it has its first token, its prompt's KV-cache blocks
    are in the prefix cache, and the prompt's other choices start on them instead of computing and holding
    the prompt again (the n choices of a prompt share its blocks)."""
    leaders = {}
    for i, choice in enumerate(choices):
        leaders.setdefault(choice.prompt_index, i)
    first = [i for i in range(len(choices)) if leaders[choices[i].prompt_index] == i]
    rest = [i for i in range(len(choices)) if leaders[choices[i].prompt_index] != i]
    for group in (first, rest):
        outcomes = await asyncio.gather(*(generations[i].start(choices[i].prompt_ids, choices[i].params, prompt_param)
                                          for i in group), return_exceptions=True)
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None:
            raise failure


def _usage(choices: list[Choice], finals: list[RequestOutput]) -> UsageInfo:
    """Every prompt counted once (n choices of one prompt share it), every choice's generated tokens."""
    prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}
    return UsageInfo.of(sum(prompts.values()), sum(f.num_output_tokens for f in finals))


# --------------------------------------------------------------------------- generation


class _Generation:
    """One request's stream of outputs from the engine.

    Invariant: once `start()` has been called, `close()` must be awaited on every path (it
    is idempotent). Closing the engine's generator is what tells the engine to abort the
    request; `close()` also calls `engine.abort` for a request that had not finished, which
    covers iterators without `aclose` (abort of an already-gone request is expected to be a no-op).
    """

    def __init__(self, engine: EngineClient, request_id: str, timer: RequestTimer | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.timer = timer  # observes every output for /metrics
        self._outputs: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._done = False  # the engine holds nothing more for this request
        self._closed = False

    async def start(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Submit the request and wait for its first output, so that a refusal is still a 400 (naming
        `prompt_param`: what the engine checks is the prompt)."""
        try:
            # An engine may validate when called or on the first step; both refusals are 400s.
            self._outputs = self.engine.generate(self.request_id, prompt_ids, params)
            self._first = await anext(self._outputs)
            if self.timer is not None:
                self.timer.output(self._first)
        except ValueError as exc:  # refused before admission: nothing to abort
            self._done = True
            raise InvalidRequestError(f"Invalid {prompt_param}: {exc}", param=prompt_param) from exc
        except StopAsyncIteration:
            self._done = True
            raise ServerError("The engine returned no output for the request.") from None
        except Exception as exc:
            raise _engine_failure(exc) from exc
        self._check(self._first)

    async def next_output(self) -> RequestOutput | None:
        """The next output, or None after the one that finished the request."""
        if self._done:
            return None
        if self._first is not None:
            output, self._first = self._first, None
        else:
            assert self._outputs is not None, "start() first"
            try:
                output = await anext(self._outputs)
            except StopAsyncIteration:
                self._done = True
                raise ServerError("The engine stopped the request before it finished.") from None
            except Exception as exc:
                raise _engine_failure(exc) from exc
            if self.timer is not None:
                self.timer.output(output)
            self._check(output)
        self._done = output.finished
        return output

    def _check(self, output: RequestOutput) -> None:
        failed = output.error is not None or (output.finished and output.finish_reason not in _CLIENT_FINISH_REASONS)
        if failed:
            self._done = output.finished
            reason = output.error or f"the request ended with finish reason '{output.finish_reason}'"
            raise ServerError(f"The engine failed to complete the request: {reason}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shielded: this runs while the handling task is being cancelled (client gone), and
        # the engine must still hear about it.
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._outputs, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
                if not self._done:
                    if self.timer is not None:
                        self.timer.aborted()
                    await self.engine.abort(self.request_id)
            except Exception:
                logger.exception("failed to release request %s", self.request_id)


def _engine_failure(exc: Exception) -> APIError:
    if isinstance(exc, ServerShuttingDown):  # a clean stop, not a failure: no traceback
        return ServiceUnavailableError(f"The server is shutting down: {exc}. Retry against another replica "
                                       f"or once it is back.")
    logger.error("engine failed while generating", exc_info=exc)
    return ServerError(f"The engine failed while generating: {type(exc).__name__}: {exc}")


async def _collect(generation: _Generation) -> tuple[RequestOutput, list[TokenLogprob]]:
    """The finishing output and every token's logprobs (each output carries only its step's)."""
    logprobs: list[TokenLogprob] = []
    final = None
    while (output := await generation.next_output()) is not None:
        logprobs.extend(output.new_logprobs or [])
        final = output
    assert final is not None, "a started generation yields at least one output"
    return final, logprobs


# --------------------------------------------------------------------------- streaming


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def _stream_events(
    generations: list[_Generation], renderer: Renderer, include_usage: bool, choices: list[Choice]
) -> AsyncGenerator[str | bytes, None]:
    """Server-sent events: one chunk per engine output of each choice, usage if asked, then `[DONE]`.

    An error after the stream has started cannot change the status code any more; it is
    sent as an `{"error": ...}` event before `[DONE]`.
    """
    # Without include_usage chunks carry no `usage` key at all; with it, `null` until the last.
    try:
        finals: dict[int, RequestOutput] = {}
        async for index, output in _outputs_of(generations):
            yield renderer.chunk_event(output, include_usage, index)
            finals[index] = output
        if include_usage and len(finals) == len(generations):
            yield _sse(renderer.usage_chunk(_usage(choices, [finals[i] for i in range(len(generations))])))
    except APIError as exc:
        yield _sse(exc.to_dict())
    except Exception as exc:
        logger.exception("failed while streaming request %s", renderer.request_id)
        yield _sse(ServerError(f"Internal error while streaming: {type(exc).__name__}").to_dict())
    for generation in generations:
        await generation.close()  # release the engine requests before the client reads the end
    yield "data: [DONE]\n\n"


async def _outputs_of(generations: list[_Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every generation as they come; the first failure is raised."""
    if len(generations) == 1:  # the common case, without a task per choice
        while (output := await generations[0].next_output()) is not None:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: _Generation) -> None:
        try:
            while (output := await generation.next_output()) is not None:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the stream
            queue.put_nowait((index, exc))

    pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(generations)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


class _EventStreamResponse(StreamingResponse):
    """Sends a request's events, and closes its generations however the response ends.

    Starlette cancels a stream whose client disconnects, which may leave the event generator
    suspended at a `yield`, or not even started; neither would run its cleanup code until
    the garbage collector got to it. Closing here releases the engine requests right away.
    """

    media_type = "text/event-stream"

    def __init__(self, generations: list[_Generation], events: AsyncGenerator[str | bytes, None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._generations = generations
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                for generation in self._generations:
                    await generation.close()


# --------------------------------------------------------------------------- disconnects


class _ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read by now, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise _ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise _ClientDisconnected
    return work_task.result()
