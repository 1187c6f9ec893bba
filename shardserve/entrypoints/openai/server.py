"""The OpenAI-compatible HTTP server in front of an engine client (requests/client.py): the app, its routes, request admission.

`build_app` wires the routes, the error handlers (errors.py) and the ASGI middlewares
(middleware.py: API-key check, request-body size limit); `serve_http` runs the app under uvicorn.
The generation routes check a request against the model's context (`_admit`) and hand it to
`serve_choices` (generation.py), one engine request per choice (n of each prompt), with the endpoint's
renderer (renderers.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import uvicorn
from jinja2 import TemplateError
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from shardserve import heap
from shardserve.entrypoints.openai.chat_output import ChatOutput, ChatParsers
from shardserve.entrypoints.openai.constraints import checked, checked_tool_schemas, constraint_of
from shardserve.entrypoints.openai.errors import (
    InvalidRequestError,
    ServiceUnavailableError,
    install_error_handlers,
    model_not_found,
)
from shardserve.entrypoints.openai.generation import Choice, serve_choices
from shardserve.entrypoints.openai.metrics import ServerMetrics
from shardserve.entrypoints.openai.middleware import BodySizeLimit, require_api_key
from shardserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from shardserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from shardserve.entrypoints.openai.renderers import ChatRenderer, CompletionRenderer
from shardserve.entrypoints.openai.tool_parsers import GenericToolParser, ToolParser
from shardserve.entrypoints.openai.tool_prompts import TOOL_FORMATS, ChatPrompter
from shardserve.entrypoints.openai.tools import tool_plan
from shardserve.requests.sampling_params import SEED_RANGE, SamplingParams, StructuredOutput
from shardserve.version import __version__

if TYPE_CHECKING:
    from shardserve.requests.client import EngineClient


def build_app(
    engine: EngineClient,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 2**20,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    chat_parsers: ChatParsers = ChatParsers(),
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under the name `served_model_name`; `chat_parsers` read tool
    calls and reasoning out of chat outputs.

    With `api_key`, every path except /health and /version requires `Authorization: Bearer <api_key>`.
    Request bodies over `max_body_bytes` are refused with 413 before they are parsed. `on_startup` runs in
    the server's event loop before it accepts connections, `on_shutdown` after it has stopped.
    """

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if on_startup is not None:
            await on_startup()
        heap.freeze_startup_objects()  # a request's objects are then all the collector walks (shardserve/heap.py)
        try:
            yield
        finally:
            heap.release_startup_objects(collect=False)  # a front end holds no device memory
            if on_shutdown is not None:
                await on_shutdown()

    app = FastAPI(title="shardserve", version=__version__, lifespan=lifespan)
    tokenizer = engine.tokenizer
    tool_parser, reasoning_parser = chat_parsers.resolve(tokenizer.chat_template)
    prompter = ChatPrompter.for_template(tokenizer.chat_template, tokenizer.chat_text,
                                         TOOL_FORMATS[tool_parser.name] if tool_parser is not None else None)
    app.state.serving = _ServingState(engine=engine, model_name=served_model_name, created=int(time.time()),
                                      prompter=prompter, tool_parser=tool_parser, reasoning_parser=reasoning_parser)
    app.state.metrics = ServerMetrics(served_model_name, engine)
    install_error_handlers(app)
    app.include_router(_router)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)
    require_api_key(app, api_key)  # added last, so it runs first: the key is checked before a body is read
    return app


def bind_http_port(host: str, port: int) -> socket.socket:
    """The server's address, taken before anything else starts: a port in use is reported at once (not
    after loading the model), and no socket the ranks open later (gloo picks free ports) can take it.
    Bound but not listening until `serve_http`, so a client gets "connection refused" until the server
    is ready, as before."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"shardserve serve: error: --host {host} --port {port}: {e.strerror or e}") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGINT/SIGTERM first tells the engine to end the requests in flight with a
    503 (uvicorn would otherwise wait for every stream to finish before it stops). With `ignore_interrupt`,
    SIGINT is left to another process (see serve_http)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[str], None] | None,
                 ignore_interrupt: bool = False) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._ignore_interrupt = ignore_interrupt

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGINT and self._ignore_interrupt:
            return
        if self._on_signal is not None and not self.should_exit:
            self._on_signal("the server received a stop signal")
        super().handle_exit(sig, frame)
        # uvicorn raises the signals it caught again once it has stopped serving; SIGTERM's default action
        # would then end the process before the engine and the other ranks shut down in order.
        getattr(self, "_captured_signals", []).clear()


def serve_http(app: FastAPI, host: str, port: int, sock: socket.socket | None = None,
               stop_when: Callable[[], str | None] | None = None, ignore_interrupt: bool = False) -> str | None:
    """Serve `app` until SIGINT/SIGTERM, on `sock` (from bind_http_port) or else binding host:port; blocks the
    calling thread. With `stop_when`, also stop (gracefully: responses under way are finished) once it returns
    a reason, which is then returned; None after a signal.

    `ignore_interrupt`: only SIGTERM stops it. For an API server process: Ctrl-C reaches the whole process
    group, and the engine core, which acts on it, stops the API servers with SIGTERM; taken here too, a SIGINT
    that arrived after that SIGTERM would count as a second Ctrl-C and make uvicorn skip its orderly shutdown."""
    config = uvicorn.Config(app, host=host, port=port, log_level="info")
    serving = getattr(app.state, "serving", None)
    server = _Server(config, on_signal=getattr(serving.engine, "stop_accepting", None) if serving else None,
                     ignore_interrupt=ignore_interrupt)
    reason: list[str] = []
    if stop_when is not None:
        def watch() -> None:
            while not server.should_exit:
                found = stop_when()
                if found:
                    reason.append(found)
                    server.should_exit = True
                    return
                time.sleep(0.5)

        threading.Thread(target=watch, name="shardserve-http-stop", daemon=True).start()
    server.run(sockets=[sock] if sock is not None else None)
    return reason[0] if reason else None


# --------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class _ServingState:
    engine: EngineClient
    model_name: str
    created: int
    prompter: ChatPrompter
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None

    @property
    def reads_generic_calls(self) -> bool:
        return self.tool_parser is not None and self.tool_parser.name == GenericToolParser.name

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise model_not_found(requested, self.model_name)


def _serving(request: Request) -> _ServingState:
    return request.app.state.serving


# Documented in /openapi.json: every error has the OpenAI shape (declaring 4XX also keeps FastAPI from
# documenting its own 422 validation body, which this server never sends).
_router = APIRouter(responses={
    "4XX": {"model": ErrorResponse, "description": "Refused; `error.param` names the request field at fault"},
    "5XX": {"model": ErrorResponse, "description": "The engine failed or is not running"},
})


def _generation_responses(body: type) -> dict[int | str, dict]:
    # With text/event-stream, the schema describes one event (OpenAPI 3.1).
    stream = {"schema": {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string",
        "description": "One JSON chunk per output (the `*StreamResponse` shape), an `{\"error\": ...}` object if "
                       "the request fails once streaming, and `[DONE]` last"}}}}
    return {200: {"model": body, "content": {"text/event-stream": stream},
                  "description": "The completion, or with `stream: true` a stream of chunks"}}


@_router.get("/health")
async def health(request: Request) -> Response:
    engine = _serving(request).engine
    details = engine.health_details()
    if not engine.is_healthy():
        why = f": {details['last_failure']}" if details.get("last_failure") else ""
        restarts = f" (restarts so far: {details['restarts']})" if "restarts" in details else ""
        raise ServiceUnavailableError(f"The engine is not running{why}{restarts}.")
    return JSONResponse({"status": "ok", **details})


@_router.post("/sleep")
async def sleep(request: Request, level: str = "1") -> Response:
    """Free the device memory: level 1 keeps the weights in host memory, level 2 drops them. Waits for
    the requests in flight; requests that arrive while asleep wait for the wake (or wake it, with
    --wake-on-request)."""
    if level not in ("1", "2"):
        raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level")
    await _serving(request).engine.sleep(int(level))
    return JSONResponse({"is_sleeping": True, "level": int(level)})


@_router.post("/wake_up")
async def wake_up(request: Request) -> Response:
    """Take the memory back: everything, or only `tags=weights` / `tags=kv_cache` (repeatable)."""
    tags = [t for value in request.query_params.getlist("tags") for t in value.split(",") if t]
    unknown = sorted(set(tags) - {"weights", "kv_cache"})
    if unknown:
        raise InvalidRequestError(f"tags are 'weights' and 'kv_cache', got {unknown}", param="tags")
    engine = _serving(request).engine
    await engine.wake_up(weights=not tags or "weights" in tags, kv_cache=not tags or "kv_cache" in tags)
    return JSONResponse({"is_sleeping": engine.is_sleeping})


@_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> Response:
    return JSONResponse({"is_sleeping": _serving(request).engine.is_sleeping})


@_router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@_router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


def _model_card(state: "_ServingState") -> ModelCard:
    return ModelCard(id=state.model_name, created=state.created, root=state.model_name,
                     max_model_len=state.engine.max_model_len)


@_router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(_serving(request))])


@_router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    state = _serving(request)
    state.check_model(model_id)
    return _model_card(state)


@_router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw_request: Request) -> TokenizeResponse:
    """A prompt's token ids as this server counts them (vLLM's endpoint)."""
    state = _serving(raw_request)
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    if body.messages is not None:
        # The prompt a chat request with these messages and tools (tool_choice left to its default) would get.
        try:
            plan = tool_plan(body.tools, None, None, generic=state.reads_generic_calls)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="tools") from None
        messages, tools = state.prompter.prepare(body.chat_messages(), plan)
        ids = _render_chat(tokenizer, messages, body.template_options(tools))
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    strs = [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids, token_strs=strs)


@_router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    state = _serving(raw_request)
    state.check_model(body.model)
    vocab = state.engine.tokenizer.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens, skip_special_tokens=False))


def _render_chat(tokenizer, messages: list[dict], options: dict) -> list[int]:
    """A conversation's prompt ids; a template that refuses the conversation is the client's error (400)."""
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except (ValueError, TemplateError) as exc:  # no chat template; the template's raise_exception
        raise InvalidRequestError(f"The chat template could not render the messages: {exc}",
                                  param="messages") from exc


@_router.post("/v1/completions", responses=_generation_responses(CompletionResponse))
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    state = _serving(raw_request)
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    prompts = [tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p) for p in body.prompt]
    constraint = constraint_of(body, tokenizer)
    structured = constraint[0] if constraint is not None else None
    candidates, n = body.num_candidates, body.num_choices
    choices = [choice for i, ids in enumerate(prompts)
               for choice in _choices(body, i, ids, state.engine.max_model_len, "prompt", structured, candidates)]
    echo = None
    if body.echo:  # each choice's text starts with its prompt's (choice j continues prompt j // n)
        texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompt]
        echo = {j: texts[j // n] for j in range(len(prompts) * n)}
    renderer = CompletionRenderer(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        model=state.model_name,
        token_text=tokenizer.token_text,
        with_logprobs=body.num_logprobs is not None,
        echo=echo,
    )
    if candidates > n:
        return await serve_choices(raw_request, state.engine, renderer, choices, body, "prompt",
                                   keep=functools.partial(_best_of, n, candidates))
    return await serve_choices(raw_request, state.engine, renderer, choices, body, "prompt")


@_router.post("/v1/chat/completions", responses=_generation_responses(ChatCompletionResponse))
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    state = _serving(raw_request)
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    output, structured = _chat_output(body, state)
    messages, tools = state.prompter.prepare(body.chat_messages(), output.plan)
    prompt_ids = _render_chat(tokenizer, messages, body.template_options(tools))
    choices = _choices(body, 0, prompt_ids, state.engine.max_model_len, "messages", structured)
    renderer = ChatRenderer(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        model=state.model_name,
        token_text=tokenizer.token_text,
        with_logprobs=body.num_logprobs is not None,
        output=output,
    )
    return await serve_choices(raw_request, state.engine, renderer, choices, body, "messages")


def _chat_output(body: ChatCompletionRequest, state: _ServingState) -> tuple[ChatOutput, StructuredOutput | None]:
    """How the request's outputs become messages, and the one constraint on them (tools or structured outputs)."""
    tokenizer = state.engine.tokenizer
    checked_tool_schemas(body.tools)
    constraint = constraint_of(body, tokenizer)
    generic = state.reads_generic_calls
    response_schema = None
    if generic and body.tools and body.tool_choice in (None, "auto") and constraint is not None:
        # The generic format's "response" takes the response_format's schema: the model answers in it or calls
        # a tool.
        response_schema = _response_schema(*constraint)
        constraint = None
    try:
        plan = body.tool_plan(generic, response_schema)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="tool_choice") from None
    if plan.mode == "auto" and state.tool_parser is None:
        raise InvalidRequestError(
            "tool_choice 'auto' (the default with tools) reads tool calls out of the model's text, and this server "
            "was started with --tool-call-parser none: start it with --tool-call-parser auto, or send tool_choice "
            "'required' or a named function (the grammar then enforces the call)", param="tool_choice")
    if plan.constraint is not None and constraint is not None:
        raise InvalidRequestError(f"tool_choice {body.tool_choice!r} constrains the output to tool calls, which "
                                  f"leaves no room for {constraint[1]}", param=constraint[1])
    if plan.constraint is not None:
        structured = checked(plan.constraint, "tools" if plan.generic else "tool_choice", tokenizer)
    else:
        structured = constraint[0] if constraint is not None else None
    return ChatOutput(plan, state.tool_parser, state.reasoning_parser), structured


def _response_schema(structured: StructuredOutput, param: str) -> dict[str, Any]:
    """The JSON schema a response_format asks for, to stand as the generic format's "response"."""
    if structured.kind == "json_object":
        return {"type": "object"}
    if structured.kind == "json":
        return json.loads(structured.spec)
    raise InvalidRequestError(
        f"{param} asks for a {structured.kind}, and on this model tools are called in the generic JSON format, "
        f"which can hold a JSON schema's answer but not a {structured.kind}: send tool_choice 'none', or a JSON "
        f"schema", param=param)


# --------------------------------------------------------------------------- admission


def _choices(body: GenerationRequest, prompt_index: int, prompt_ids: list[int], max_model_len: int,
             prompt_param: str, structured: StructuredOutput | None = None, count: int | None = None) -> list[Choice]:
    """The request's n choices (or `count` candidates) of one prompt. With a seed, choice k samples with seed + k
    (as vLLM does), so the choices differ and each is reproducible. Candidates for best_of report their tokens'
    logprobs (what they are ranked by), which the response shows only when the request asked for them."""
    params = _admit(body, prompt_ids, max_model_len, prompt_param, structured)
    count = count or body.num_choices
    if count > body.num_choices and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)

    def seed(k: int) -> int:  # seed + k, wrapped into the 64-bit range seeds have
        value = params.seed + k
        return value - 2**64 if value > SEED_RANGE[1] else value

    return [Choice(prompt_index, prompt_ids,
                   params if params.seed is None or k == 0 else dataclasses.replace(params, seed=seed(k)))
            for k in range(count)]



def _best_of(n: int, candidates: int, results: list) -> list[int]:
    """Of each prompt's candidates (consecutive in `results`, as (final output, logprobs)), the n with the highest
    cumulative logprob, best first: the indices kept."""
    kept = []
    for start in range(0, len(results), candidates):
        group = range(start, start + candidates)
        kept += sorted(group, key=lambda i: -sum(lp.logprob for lp in results[i][1]))[:n]
    return kept


def _admit(body: GenerationRequest, prompt_ids: list[int], max_model_len: int, prompt_param: str,
           structured: StructuredOutput | None) -> SamplingParams:
    """The request's SamplingParams, once the prompt and the completion are known to fit the context."""
    if not prompt_ids:
        raise InvalidRequestError("The prompt is empty.", param=prompt_param)
    max_tokens = _max_tokens(body, len(prompt_ids), max_model_len, prompt_param)
    try:
        return body.to_sampling_params(max_tokens, structured)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def _max_tokens(body: GenerationRequest, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    """The completion budget: what the request asks for, or by default all the context the prompt leaves."""
    requested = body.requested_max_tokens
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if requested is not None and requested >= max_model_len:
        # No prompt could make this fit: the limit itself is what to change.
        raise InvalidRequestError(
            f"{limit} However, {body.max_tokens_param} is {requested}, which leaves no room for a prompt. "
            f"Please set {body.max_tokens_param} below {max_model_len}.",
            param=body.max_tokens_param,
            code="context_length_exceeded",
        )
    if requested is not None and prompt_len + requested > max_model_len:
        raise InvalidRequestError(
            f"{limit} However, you requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
            f"{requested} for the completion). Please reduce the length of the {prompt_param} or completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"{limit} However, your {prompt_param} came to {prompt_len} tokens, which leaves no room for a "
            f"completion. Please reduce the length of the {prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return requested if requested is not None else max_model_len - prompt_len
