"""The OpenAI-compatible HTTP server in front of an `AsyncEngine`.

`build_app` wires the routes, the error handlers (errors.py) and two ASGI middlewares (API-key
check, request-body size limit); `serve_http` runs the app under uvicorn.

Every request that reaches the engine is owned by a `_Generation`, whose `close()` runs on
every exit path (finished, failed, client gone), so an abandoned request never keeps its
KV-cache blocks: the handler closes it for plain JSON responses, `_EventStreamResponse`
for streams.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardserve import __version__
from shardserve.engine.outputs import RequestOutput, TokenLogprob
from shardserve.engine.sampling_params import SamplingParams
from shardserve.entrypoints.openai.errors import (
    APIError,
    AuthenticationError,
    InvalidRequestError,
    RequestTooLargeError,
    ServerError,
    ServiceUnavailableError,
    install_error_handlers,
    model_not_found,
)
from shardserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobsFormatter,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    GenerationRequest,
    ModelCard,
    ModelList,
    TokenText,
    UsageInfo,
    chat_logprobs,
)

if TYPE_CHECKING:
    from shardserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Paths a load balancer or operator may probe without the API key.
PUBLIC_PATHS = frozenset({"/health", "/version"})

# Finish reasons a client may see; the engine's "abort" and "error" become error responses.
_CLIENT_FINISH_REASONS = frozenset({"stop", "length"})

# Status logged for requests whose client went away; nobody receives the response.
_CLIENT_CLOSED_REQUEST = 499


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 2**20,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under the name `served_model_name`.

    With `api_key`, every path except /health and /version requires `Authorization: Bearer <api_key>`.
    Request bodies over `max_body_bytes` are refused with 413 before they are parsed.
    """
    app = FastAPI(title="shardserve", version=__version__)
    app.state.serving = _ServingState(engine=engine, model_name=served_model_name, created=int(time.time()))
    install_error_handlers(app)
    app.include_router(_router)
    # Starlette runs the middleware added last first: the key is checked before a body is read.
    app.add_middleware(_BodySizeLimit, max_body_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key, public_paths=PUBLIC_PATHS)
    return app


def serve_http(app: FastAPI, host: str, port: int) -> None:
    """Serve `app` until SIGINT/SIGTERM; blocks the calling thread."""
    uvicorn.run(app, host=host, port=port, log_level="info")


# --------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class _ServingState:
    engine: AsyncEngine
    model_name: str
    created: int

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise model_not_found(requested, self.model_name)


def _serving(request: Request) -> _ServingState:
    return request.app.state.serving


_router = APIRouter()


@_router.get("/health")
async def health(request: Request) -> Response:
    if not _serving(request).engine.is_healthy():
        raise ServiceUnavailableError("The engine is not running.")
    return JSONResponse({"status": "ok"})


@_router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@_router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = _serving(request)
    card = ModelCard(
        id=state.model_name,
        created=state.created,
        root=state.model_name,
        max_model_len=state.engine.max_model_len,
    )
    return ModelList(data=[card])


@_router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    state = _serving(raw_request)
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    if isinstance(body.prompt, str):
        prompt_ids = tokenizer.encode(body.prompt, add_special_tokens=True)
    else:
        prompt_ids = list(body.prompt)
    params = _admit(body, prompt_ids, state.engine.max_model_len, prompt_param="prompt")
    renderer = _CompletionRenderer(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        model=state.model_name,
        token_text=tokenizer.token_text,
        with_logprobs=params.logprobs is not None,
    )
    return await _serve_generation(raw_request, state.engine, renderer, prompt_ids, params, body)


@_router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    state = _serving(raw_request)
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    try:
        prompt_ids = tokenizer.apply_chat_template(body.chat_messages(), add_generation_prompt=True)
    except ValueError as exc:  # e.g. the model has no chat template
        raise InvalidRequestError(str(exc), param="messages") from exc
    params = _admit(body, prompt_ids, state.engine.max_model_len, prompt_param="messages")
    renderer = _ChatRenderer(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        model=state.model_name,
        token_text=tokenizer.token_text,
        with_logprobs=params.logprobs is not None,
    )
    return await _serve_generation(raw_request, state.engine, renderer, prompt_ids, params, body)


# --------------------------------------------------------------------------- admission


def _admit(body: GenerationRequest, prompt_ids: list[int], max_model_len: int, prompt_param: str) -> SamplingParams:
    """The request's SamplingParams, once the prompt and the completion are known to fit the context."""
    if not prompt_ids:
        raise InvalidRequestError("The prompt is empty.", param=prompt_param)
    max_tokens = _max_tokens(body.requested_max_tokens, len(prompt_ids), max_model_len, prompt_param)
    try:
        return body.to_sampling_params(max_tokens)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    """The completion budget: `requested`, or by default all the context the prompt leaves."""
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if requested is not None and prompt_len + requested > max_model_len:
        raise InvalidRequestError(
            f"{limit} However, you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the length of the prompt or completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"{limit} However, your prompt is {prompt_len} tokens long, which leaves no room for a completion. "
            "Please reduce the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return requested if requested is not None else max_model_len - prompt_len


# --------------------------------------------------------------------------- generation


class _Generation:
    """One request's stream of outputs from the engine.

    Invariant: once `start()` has been called, `close()` must be awaited on every path (it
    is idempotent). Closing the engine's generator is what tells the engine to abort the
    request; `close()` also calls `engine.abort` for a request that had not finished, which
    covers iterators without `aclose` (abort of an already-gone request is expected to be a no-op).
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self._outputs: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._done = False  # the engine holds nothing more for this request
        self._closed = False

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Submit the request and wait for its first output, so that a refusal is still a 400."""
        try:
            # An engine may validate when called or on the first step; both refusals are 400s.
            self._outputs = self.engine.generate(self.request_id, prompt_ids, params)
            self._first = await anext(self._outputs)
        except ValueError as exc:  # refused before admission: nothing to abort
            self._done = True
            raise InvalidRequestError(str(exc)) from exc
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
                    await self.engine.abort(self.request_id)
            except Exception:
                logger.exception("failed to release request %s", self.request_id)


def _engine_failure(exc: Exception) -> ServerError:
    logger.error("engine failed while generating", exc_info=exc)
    return ServerError(f"The engine failed while generating: {type(exc).__name__}: {exc}")


class _Renderer(Protocol):
    """Turns engine outputs into one endpoint's response bodies."""

    request_id: str

    def chunk(self, output: RequestOutput) -> BaseModel: ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob]) -> BaseModel: ...


def _usage(output: RequestOutput) -> UsageInfo:
    return UsageInfo.of(output.num_prompt_tokens, output.num_output_tokens)


class _CompletionRenderer:
    def __init__(self, request_id: str, model: str, token_text: TokenText, with_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self._logprobs = CompletionLogprobsFormatter(token_text) if with_logprobs else None

    def _choice(self, text: str, logprobs: list[TokenLogprob] | None, output: RequestOutput) -> CompletionChoice:
        return CompletionChoice(
            text=text,
            logprobs=self._logprobs.format(logprobs or []) if self._logprobs else None,
            finish_reason=output.finish_reason if output.finished else None,
        )

    def chunk(self, output: RequestOutput) -> CompletionStreamResponse:
        choice = self._choice(output.delta_text, output.new_logprobs, output)
        return CompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob]) -> CompletionResponse:
        choice = self._choice(final.text, logprobs, final)
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=_usage(final))


class _ChatRenderer:
    def __init__(self, request_id: str, model: str, token_text: TokenText, with_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self._token_text = token_text
        self._with_logprobs = with_logprobs
        self._role_sent = False

    def chunk(self, output: RequestOutput) -> ChatCompletionStreamResponse:
        # The first chunk announces the speaker, as OpenAI's streams do.
        delta = DeltaMessage(role=None if self._role_sent else "assistant", content=output.delta_text)
        self._role_sent = True
        choice = ChatCompletionStreamChoice(
            delta=delta,
            logprobs=self._logprobs(output.new_logprobs or []),
            finish_reason=output.finish_reason if output.finished else None,
        )
        return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob]) -> ChatCompletionResponse:
        choice = ChatCompletionChoice(
            message=ChatResponseMessage(content=final.text),
            logprobs=self._logprobs(logprobs),
            finish_reason=final.finish_reason,
        )
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=_usage(final))

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(logprobs, self._token_text) if self._with_logprobs else None


async def _serve_generation(
    raw_request: Request,
    engine: AsyncEngine,
    renderer: _Renderer,
    prompt_ids: list[int],
    params: SamplingParams,
    body: GenerationRequest,
) -> Response:
    generation: _Generation | None = _Generation(engine, renderer.request_id)
    try:
        await _unless_disconnected(raw_request, generation.start(prompt_ids, params))
        if body.stream:
            response = _EventStreamResponse(generation, _stream_events(generation, renderer, body.include_usage))
            generation = None  # the response owns it from here and closes it
            return response
        final, logprobs = await _unless_disconnected(raw_request, _collect(generation))
        return JSONResponse(renderer.response(final, logprobs).model_dump(mode="json"))
    except _ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    finally:
        if generation is not None:
            await generation.close()


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


def _sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    data = payload.model_dump_json(exclude=exclude) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def _stream_events(
    generation: _Generation, renderer: _Renderer, include_usage: bool
) -> AsyncGenerator[str, None]:
    """Server-sent events: one chunk per engine output, usage if asked, then `[DONE]`.

    An error after the stream has started cannot change the status code any more; it is
    sent as an `{"error": ...}` event before `[DONE]`.
    """
    # Without include_usage chunks carry no `usage` key at all; with it, `null` until the last.
    exclude = None if include_usage else {"usage"}
    try:
        last = None
        while (output := await generation.next_output()) is not None:
            yield _sse(renderer.chunk(output), exclude)
            last = output
        if include_usage and last is not None:
            yield _sse(renderer.usage_chunk(_usage(last)))
    except APIError as exc:
        yield _sse(exc.to_dict())
    except Exception as exc:
        logger.exception("failed while streaming request %s", renderer.request_id)
        yield _sse(ServerError(f"Internal error while streaming: {type(exc).__name__}").to_dict())
    await generation.close()  # release the engine request before the client reads the end
    yield "data: [DONE]\n\n"


class _EventStreamResponse(StreamingResponse):
    """Sends a generation's events, and closes the generation however the response ends.

    Starlette cancels a stream whose client disconnects, which may leave the event generator
    suspended at a `yield`, or not even started; neither would run its cleanup code until
    the garbage collector got to it. Closing here releases the engine request right away.
    """

    media_type = "text/event-stream"

    def __init__(self, generation: _Generation, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._generation = generation
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._generation.close()


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


# --------------------------------------------------------------------------- middleware


class _BearerAuth:
    """Requires `Authorization: Bearer <api_key>` on every path but `public_paths`."""

    def __init__(self, app: ASGIApp, api_key: str, public_paths: Collection[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public_paths:
            await self.app(scope, receive, send)
            return
        error = self._check(Headers(scope=scope).get("authorization"))
        if error is None:
            await self.app(scope, receive, send)
            return
        response = error.to_response(headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _check(self, authorization: str | None) -> AuthenticationError | None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return AuthenticationError("Missing API key: send it in an 'Authorization: Bearer <key>' header.")
        if not hmac.compare_digest(token.encode(), self._key):
            return AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        return None


class _BodySizeLimit:
    """Reads each request body in full and answers 413 once it exceeds `max_body_bytes`.

    The app then receives the body as a single message; later `receive()` calls go to the
    server, so handlers still hear about the client disconnecting.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large()(scope, receive, send)
            return

        chunks: list[bytes] = []
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)

        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self) -> Response:
        limit = self.max_body_bytes
        error = RequestTooLargeError(f"The request body is larger than this server's limit of {limit} bytes.")
        # The rest of the body is never read, so the connection cannot be reused.
        return error.to_response(headers={"Connection": "close"})


def _replay(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
