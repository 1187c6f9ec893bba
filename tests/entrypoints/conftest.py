"""Fixtures for the HTTP-layer tests: the real engine behind the real app, and one failure-injection double.

`server` is a real TP=1 engine on a tiny random Llama (tests/tiny_models.py) behind the real FastAPI
app, shared by a test module. Its vocabulary is "w5".."w999" plus special tokens, so prompts are
written in those words; greedy requests (temperature 0) are deterministic, and with `ignore_eos`
they run to exactly `max_tokens`.

`engine_spy` records what reaches the real engine (requests added, requests aborted) without
changing what it does. `FailingEngine` is the only stand-in: the real engine with a failure injected
part-way through each request, for the paths where the engine breaks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, aclosing
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from shardserve.engine.async_engine import AsyncEngine
from shardserve.entrypoints.openai.chat_output import ChatParsers
from shardserve.entrypoints.openai.server import build_app
from shardserve.requests.outputs import RequestOutput
from shardserve.requests.sampling_params import SamplingParams
from shardserve.tokenizer import Tokenizer
from tests.serving import InProcessServer, serve_in_thread, serve_model

MODEL = "tiny"
TINY_MODEL = "llama-tied"
MAX_MODEL_LEN = 128
API_KEY = "sk-test-key"
SMALL_BODY_LIMIT = 1024
# How every real engine here runs: a short context, so over-long prompts stay short to write.
ENGINE_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.05)
SIMULATED_FAILURE = "simulated engine failure"


# --------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[InProcessServer]:
    """The real engine behind the real app, with the default app options."""
    with serve_model(tiny_model_dir(TINY_MODEL), name=MODEL, **ENGINE_OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def secured_server(tiny_model_dir) -> Iterator[InProcessServer]:
    """A real server that requires `Authorization: Bearer API_KEY`."""
    with serve_model(tiny_model_dir(TINY_MODEL), name=MODEL, api_key=API_KEY, **ENGINE_OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def small_body_server(tiny_model_dir) -> Iterator[InProcessServer]:
    """A real server that refuses request bodies over SMALL_BODY_LIMIT bytes."""
    with serve_model(tiny_model_dir(TINY_MODEL), name=MODEL, max_body_bytes=SMALL_BODY_LIMIT,
                     **ENGINE_OPTIONS) as running:
        yield running


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir) -> Tokenizer:
    """The served model's tokenizer, loaded on its own, to count and decode tokens independently."""
    return Tokenizer.from_model_path(tiny_model_dir(TINY_MODEL))


@pytest.fixture
def client(server: InProcessServer) -> openai.OpenAI:
    return server.openai()


@pytest.fixture
def http(server: InProcessServer) -> Iterator[httpx.Client]:
    with server.http() as http_client:
        yield http_client


# --------------------------------------------------------------------------- observing the real engine


@dataclass
class EngineSpy:
    """What reached the real engine during one test.

    added: request id -> (prompt token ids, sampling params) as the engine received them.
    aborted: request id -> tokens generated so far, for each abort that found the request running.
    abort_calls: every request id the engine was asked to abort, running or not.
    """

    added: dict[str, tuple[list[int], SamplingParams]] = field(default_factory=dict)
    aborted: dict[str, int] = field(default_factory=dict)
    abort_calls: list[str] = field(default_factory=list)


@pytest.fixture
def engine_spy(server: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> EngineSpy:
    """Records the `server` engine's add_request/abort calls (made on its engine thread), then delegates."""
    spy = EngineSpy()
    engine = server.engine.engine
    add_request, abort = engine.add_request, engine.abort

    def recording_add_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        add_request(request_id, prompt_token_ids, params)
        spy.added[request_id] = (list(prompt_token_ids), params)

    def recording_abort(request_id: str) -> RequestOutput | None:
        spy.abort_calls.append(request_id)
        output = abort(request_id)
        if output is not None:
            spy.aborted[request_id] = output.num_output_tokens
        return output

    monkeypatch.setattr(engine, "add_request", recording_add_request)
    monkeypatch.setattr(engine, "abort", recording_abort)
    return spy


# --------------------------------------------------------------------------- failure injection


class FailingEngine:
    """Failure-injection double: the real engine, except that every request breaks part-way.

    Each request runs on the wrapped real AsyncEngine; after it has yielded `fail_after` outputs,
    the next one is replaced by `RuntimeError(SIMULATED_FAILURE)`, as if the engine had crashed
    mid-generation. The real request is closed, so the engine releases it as it would any other.
    """

    def __init__(self, engine: AsyncEngine, fail_after: int) -> None:
        self._engine = engine
        self.fail_after = fail_after
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    def __getattr__(self, name: str):
        return getattr(self._engine, name)  # the rest of EngineClient: the real engine's

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        async with aclosing(self._engine.generate(request_id, prompt_token_ids, params)) as outputs:
            delivered = 0
            async for output in outputs:
                if delivered == self.fail_after:
                    raise RuntimeError(SIMULATED_FAILURE)
                yield output
                delivered += 1


@pytest.fixture
def serve_failing(server: InProcessServer) -> Iterator[Callable[[int], InProcessServer]]:
    """Factory: serve_failing(fail_after) -> the real app over FailingEngine(`server`'s engine).

    The returned InProcessServer's `engine` is the real engine underneath, so its KV blocks can be checked.
    """
    with ExitStack() as stack:

        def start(fail_after: int) -> InProcessServer:
            app = build_app(FailingEngine(server.engine, fail_after), MODEL)
            url = stack.enter_context(serve_in_thread(app))
            return InProcessServer(url, MODEL, server.engine)

        yield start


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 with a byte-level tokenizer (any text encodes) and a chat template with tools in the
    hermes format (<tool_call> tags): random weights, so every structure in its outputs comes from a grammar."""
    from dataclasses import replace

    from tests.tiny_models import TINY_SPECS, make_tiny_model

    qwen2 = TINY_SPECS["qwen2"]  # a token per byte: prompts with tools run to a few hundred tokens
    spec = replace(qwen2, name="qwen2-bytes", config={**qwen2.config, "max_position_embeddings": 2048})
    return make_tiny_model(spec, str(tmp_path_factory.mktemp("byte-model")), tokenizer="bytes")


@pytest.fixture(scope="module")
def byte_server(byte_model_dir) -> Iterator[InProcessServer]:
    with serve_model(byte_model_dir, name=MODEL, max_model_len=2048, kv_cache_memory_gb=0.05) as running:
        yield running


@pytest.fixture
def byte_http(byte_server: InProcessServer) -> Iterator[httpx.Client]:
    with byte_server.http() as http_client:
        yield http_client


@pytest.fixture(scope="module")
def byte_app_client(byte_server: InProcessServer) -> Iterator[Callable[[ChatParsers], httpx.Client]]:
    """Factory: byte_app_client(chat_parsers) -> a client of the real app built with those parsers (as the
    server's --tool-call-parser and --reasoning-parser set them) over `byte_server`'s engine."""
    with ExitStack() as stack:

        def start(chat_parsers: ChatParsers) -> httpx.Client:
            url = stack.enter_context(serve_in_thread(build_app(byte_server.engine, MODEL, chat_parsers=chat_parsers)))
            return stack.enter_context(httpx.Client(base_url=url, timeout=120))

        yield start
