"""Fixtures for the HTTP layer: a tiny real tokenizer, an engine test double, and a live server.

`EchoEngine` stands in for `shardserve.engine.async_engine.AsyncEngine` so the server can be
tested without a model: it implements the same interface and "generates" the prompt's own
tokens back, deterministically. It is a test double for the HTTP layer only.
"""

from __future__ import annotations

import asyncio
import socket
import string
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shardserve.engine.outputs import RequestOutput, TokenLogprob
from shardserve.engine.sampling_params import SamplingParams
from shardserve.entrypoints.openai.server import build_app
from tests.serving import serve_in_thread

MODEL_NAME = "echo-model"


class CharTokenizer:
    """One token per printable ASCII character, plus <unk>, <s> (BOS) and </s> (EOS).

    Built with the `tokenizers` library and shaped like `shardserve.tokenizer.Tokenizer`.
    """

    SPECIALS = ("<unk>", "<s>", "</s>")

    def __init__(self) -> None:
        vocab = {token: i for i, token in enumerate([*self.SPECIALS, *sorted(set(string.printable))])}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tokenizer.add_special_tokens(list(self.SPECIALS))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
        )
        self._tokenizer = tokenizer
        self.bos_token_id = vocab["<s>"]
        self.eos_token_ids = frozenset({vocab["</s>"]})
        self.special_token_ids = frozenset(vocab[t] for t in self.SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id) or ""


class EchoEngine:
    """Deterministic stand-in for AsyncEngine.

    Output: the prompt's non-special tokens, `tokens_per_step` per step, then EOS (finish
    "stop"); with `ignore_eos` the prompt repeats until `max_tokens` (finish "length").
    Stop strings and stop token ids end the request as the real engine does. Every request
    that stops before finishing, whether its generator is closed or `abort` is called, is
    recorded in `aborted`.
    """

    def __init__(self, tokenizer: CharTokenizer, max_model_len: int = 256) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.tokens_per_step = 2
        self.step_delay = 0.0  # seconds per step; tests of cancellation slow the engine down
        self.healthy = True
        self.fail_after_steps: int | None = None  # raise mid-generation after this many steps
        self.refusal: str | None = None  # refuse every request with this ValueError message
        self.submitted: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: set[str] = set()
        self.finished: set[str] = set()

    def is_healthy(self) -> bool:
        return self.healthy

    async def abort(self, request_id: str) -> None:
        if request_id not in self.finished:
            self.aborted.add(request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self.refusal is not None:
            raise ValueError(self.refusal)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        self.submitted[request_id] = (list(prompt_token_ids), params)
        steps = _EchoSteps(self.tokenizer, prompt_token_ids, params)
        finished = False
        try:
            step = 0
            while not finished:
                await asyncio.sleep(self.step_delay)
                if self.fail_after_steps is not None and step >= self.fail_after_steps:
                    raise RuntimeError("simulated engine failure")
                output = steps.advance(request_id, self.tokens_per_step)
                finished = output.finished
                step += 1
                yield output
        finally:
            if finished:
                self.finished.add(request_id)
            else:
                self.aborted.add(request_id)


class _EchoSteps:
    """The growing output of one EchoEngine request."""

    def __init__(self, tokenizer: CharTokenizer, prompt: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.params = params
        self.script = [t for t in prompt if t not in tokenizer.special_token_ids]
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_token_ids))
        self.token_ids: list[int] = []
        self.text = ""

    def _next_token(self) -> int:
        position = len(self.token_ids)
        if self.params.ignore_eos:
            return self.script[position % len(self.script)] if self.script else self.tokenizer.bos_token_id
        if position < len(self.script):
            return self.script[position]
        return min(self.tokenizer.eos_token_ids)

    def _logprob(self, token_id: int) -> TokenLogprob:
        alternatives = [(token_id, -0.25)] + [((token_id + j) % 100 + 3, -1.0 - j) for j in range(1, 5)]
        return TokenLogprob(token_id=token_id, logprob=-0.25, top=alternatives[: self.params.logprobs])

    def advance(self, request_id: str, count: int) -> RequestOutput:
        new_ids: list[int] = []
        finish_reason = None
        for _ in range(count):
            token = self._next_token()
            if token in self.stop_ids:
                finish_reason = "stop"
                break
            new_ids.append(token)
            self.token_ids.append(token)
            if len(self.token_ids) >= self.params.max_tokens:
                finish_reason = "length"
                break
        text = self.tokenizer.decode(self.token_ids)
        for stop in self.params.stop:
            if stop in text:
                text, finish_reason = text[: text.index(stop)], "stop"
        delta, self.text = text[len(self.text):], text
        logprobs = [self._logprob(t) for t in new_ids] if self.params.logprobs is not None else None
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=self.prompt,
            token_ids=list(self.token_ids),
            text=text,
            new_token_ids=new_ids,
            delta_text=delta,
            new_logprobs=logprobs,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
        )


# --------------------------------------------------------------------------- live server


@dataclass
class LiveServer:
    url: str
    engine: EchoEngine
    api_key: str | None
    model: str = MODEL_NAME

    def openai(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused", max_retries=0, timeout=30
        )

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 30, **kwargs})

    @staticmethod
    def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Poll `condition` (the server runs in another thread) until it holds or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


@pytest.fixture(scope="session")
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture
def engine(tokenizer: CharTokenizer) -> EchoEngine:
    return EchoEngine(tokenizer)


@pytest.fixture
def start_server(engine: EchoEngine) -> Iterator[Callable[..., LiveServer]]:
    """Factory: start_server(api_key=..., max_body_bytes=...) -> a running LiveServer over `engine`."""
    with ExitStack() as stack:

        def start(**build_kwargs) -> LiveServer:
            app = build_app(engine, MODEL_NAME, **build_kwargs)
            url = stack.enter_context(serve_in_thread(app))
            return LiveServer(url=url, engine=engine, api_key=build_kwargs.get("api_key"))

        yield start


@pytest.fixture
def server(start_server: Callable[..., LiveServer]) -> LiveServer:
    return start_server()


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return server.openai()


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with server.http() as http_client:
        yield http_client

