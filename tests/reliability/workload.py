"""Greedy requests of every shape a client sends, and what a well-formed answer to each one is.

A `Job` is one request: /v1/completions or /v1/chat/completions, streamed or not, with a prompt and
an output length drawn from a seeded mix. `send` runs it over HTTP and returns the `Answer` read from
the body, or raises `Failure` saying what went wrong, by kind (the figures count failures by kind).

Every job is greedy (temperature 0), so its answer must not depend on what else the server runs:
the same job sent alone gives the reference (`solo`) that an answer under load must equal. One
exception is not a fault: where the two best tokens are tied to within float32 rounding, a batch of
another shape may round the other way. Each job asks for the two best logprobs per token, so such a
tie can be told apart from a real difference (`near_tie`).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

MODEL = "tiny"
# The tiny test models' vocabulary is "w5".."w999" (tests/tiny_models.py).
FIRST_WORD, VOCAB = 5, 1000
# Two logprobs closer than this are a tie as far as float32 arithmetic in different batch shapes can tell:
# rounding moves them by about 1e-6; the gap between a model's two best tokens is usually 0.01 or more.
TIE_LOGPROB = 1e-4


@dataclass(frozen=True)
class Job:
    index: int
    endpoint: Literal["completions", "chat"]
    stream: bool
    words: tuple[str, ...]
    max_tokens: int
    ignore_eos: bool  # without it the model may stop early at its end-of-sequence token
    include_usage: bool  # streams only: end with a usage chunk

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens, "temperature": 0,
                                "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.stream and self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.endpoint == "completions":
            body |= {"prompt": " ".join(self.words), "logprobs": 2}
        else:
            body |= {"messages": [{"role": "user", "content": " ".join(self.words)}], "logprobs": True,
                     "top_logprobs": 2}
        return body


def make_jobs(n: int, seed: int, max_prompt_words: int, max_tokens: int, stream: bool | None = None) -> list[Job]:
    """n jobs, half completions and half chat, half streamed (or all `stream`), prompts short (1-8
    words), medium or long (up to `max_prompt_words`), outputs of 1 to `max_tokens` tokens."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        kind = rng.choice(("short", "medium", "long"))
        length = {"short": rng.randint(1, 8), "medium": rng.randint(9, max(9, max_prompt_words // 3)),
                  "long": rng.randint(max(10, max_prompt_words // 3), max_prompt_words)}[kind]
        words = tuple(f"w{rng.randrange(FIRST_WORD, VOCAB)}" for _ in range(length))
        streamed = rng.random() < 0.5 if stream is None else stream
        jobs.append(Job(i, rng.choice(("completions", "chat")), streamed, words, rng.randint(1, max_tokens),
                        ignore_eos=rng.random() < 0.5, include_usage=streamed and rng.random() < 0.5))
    return jobs


@dataclass(frozen=True)
class Answer:
    text: str
    completion_tokens: int
    finish_reason: str
    tokens: tuple[str, ...] = ()  # each generated token's text
    best: tuple[dict[str, float], ...] = ()  # each position's two best tokens and their logprobs

    def same_as(self, other: Answer) -> bool:
        """The same generation (logprob values may differ in their last bits between batch shapes)."""
        return (self.text, self.completion_tokens, self.finish_reason, self.tokens) == (
            other.text, other.completion_tokens, other.finish_reason, other.tokens)


def near_tie(solo: Answer, other: Answer) -> bool:
    """Whether `other` first departs from `solo` where solo's two best tokens were tied (TIE_LOGPROB)."""
    k = next((i for i, (a, b) in enumerate(zip(solo.tokens, other.tokens)) if a != b), None)
    if k is None or k >= len(solo.best):
        return False
    best = solo.best[k]
    ours, theirs = best.get(solo.tokens[k]), best.get(other.tokens[k])
    return ours is not None and theirs is not None and abs(ours - theirs) <= TIE_LOGPROB


class Failure(Exception):
    """A request that did not get a well-formed answer; `kind` groups failures in the figures."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


async def send(client: httpx.AsyncClient, job: Job) -> Answer:
    """Run `job`; raises Failure("transport" | "status NNN" | "malformed" | "error event", ...)."""
    try:
        if not job.stream:
            response = await client.post(job.path, json=job.body())
            _expect_ok(response, "application/json")
            return _check_response(job, response.json())
        async with client.stream("POST", job.path, json=job.body()) as response:
            if response.status_code != 200:
                await response.aread()
            _expect_ok(response, "text/event-stream")
            lines = [line async for line in response.aiter_lines()]
        return _check_stream(job, lines)
    except httpx.HTTPError as exc:
        raise Failure("transport", f"{type(exc).__name__}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise Failure("malformed", f"a body that is not JSON: {exc}") from exc


async def send_all(url: str, jobs: Iterable[Job], concurrency: int) -> dict[int, Answer | Failure]:
    """Every job, at most `concurrency` in flight at once, each on its own connection slot."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one(job: Job) -> tuple[int, Answer | Failure]:
            async with gate:
                try:
                    return job.index, await send(client, job)
                except Failure as failure:
                    return job.index, failure

        return dict(await asyncio.gather(*(one(job) for job in jobs)))


async def send_one_by_one(url: str, jobs: Iterable[Job]) -> dict[int, Answer | Failure]:
    """The solo runs: each job alone on the server."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        results: dict[int, Answer | Failure] = {}
        for job in jobs:
            try:
                results[job.index] = await send(client, job)
            except Failure as failure:
                results[job.index] = failure
        return results


# --------------------------------------------------------------------------- well-formed answers


def _expect_ok(response: httpx.Response, content_type: str) -> None:
    if response.status_code != 200:
        raise Failure(f"status {response.status_code}", response.text[:300])
    if not response.headers.get("content-type", "").startswith(content_type):
        raise Failure("malformed", f"content-type {response.headers.get('content-type')!r}, not {content_type}")


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise Failure("malformed", what)


def _check_usage(job: Job, usage: Any) -> int:
    _require(isinstance(usage, dict) and all(type(usage.get(k)) is int for k in
                                             ("prompt_tokens", "completion_tokens", "total_tokens")),
             f"usage is not three integers: {usage!r}")
    _require(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"],
             f"usage does not add up: {usage}")
    return usage["completion_tokens"]


def _check_length(job: Job, completion_tokens: int, finish_reason: str) -> None:
    _require(1 <= completion_tokens <= job.max_tokens, f"{completion_tokens} tokens for max_tokens {job.max_tokens}")
    _require(finish_reason in ("stop", "length"), f"finish_reason {finish_reason!r}")
    _require(finish_reason == "stop" or completion_tokens == job.max_tokens,
             f"finish_reason 'length' after {completion_tokens} of {job.max_tokens} tokens")
    _require(not job.ignore_eos or finish_reason == "length", "stopped early despite ignore_eos")


def _token_logprobs(job: Job, logprobs: Any) -> tuple[list[str], list[dict[str, float]]]:
    """(token texts, each position's best alternatives) from a choice's `logprobs`, in either format."""
    _require(isinstance(logprobs, dict), f"no logprobs: {logprobs!r}")
    if job.endpoint == "completions":
        tokens, best = logprobs.get("tokens"), logprobs.get("top_logprobs")
        _require(isinstance(tokens, list) and isinstance(best, list) and len(tokens) == len(best),
                 "completion logprobs without matching tokens and top_logprobs")
        best = [dict(b) for b in best]
    else:
        content = logprobs.get("content")
        _require(isinstance(content, list), "chat logprobs without content")
        tokens = [c["token"] for c in content]
        best = [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content]
    _require(all(len(b) <= 2 and all(lp <= 0 for lp in b.values()) for b in best),
             "more than the two best alternatives, or a positive logprob")
    return tokens, best


def _check_response(job: Job, body: Any) -> Answer:
    chat = job.endpoint == "chat"
    _require(isinstance(body, dict), "the body is not a JSON object")
    _require(body.get("object") == ("chat.completion" if chat else "text_completion"), f"object {body.get('object')!r}")
    _require(str(body.get("id", "")).startswith("chatcmpl-" if chat else "cmpl-"), f"id {body.get('id')!r}")
    _require(body.get("model") == MODEL and type(body.get("created")) is int, "model or created missing")
    choices = body.get("choices")
    _require(isinstance(choices, list) and len(choices) == 1 and choices[0].get("index") == 0,
             f"choices {choices!r}")
    choice = choices[0]
    if chat:
        message = choice.get("message") or {}
        _require(message.get("role") == "assistant", f"message role {message.get('role')!r}")
        text = message.get("content")
    else:
        text = choice.get("text")
    _require(isinstance(text, str), "no text")
    tokens = _check_usage(job, body.get("usage"))
    _check_length(job, tokens, choice.get("finish_reason"))
    token_texts, best = _token_logprobs(job, choice.get("logprobs"))
    _require(len(token_texts) == tokens, f"logprobs for {len(token_texts)} tokens, usage says {tokens}")
    return Answer(text, tokens, choice["finish_reason"], tuple(token_texts), tuple(best))


def _check_stream(job: Job, lines: list[str]) -> Answer:
    """Server-sent events: `data: {chunk}` lines separated by blank lines, the last `data: [DONE]`."""
    _require(all(line.startswith("data: ") for line in lines if line), "a line that is not a data event")
    events = [line.removeprefix("data: ") for line in lines if line]
    _require(bool(events) and events[-1] == "[DONE]", "the stream does not end with [DONE]")
    chunks = [json.loads(event) for event in events[:-1]]
    errors = [chunk["error"] for chunk in chunks if "error" in chunk]
    if errors:
        raise Failure("error event", str(errors[0].get("message")))
    usage = None
    if job.include_usage:
        _require(bool(chunks) and chunks[-1].get("choices") == [], "no closing usage chunk")
        usage = chunks.pop()["usage"]
    chat = job.endpoint == "chat"
    _require(len({c.get("id") for c in chunks}) == 1, "the chunks do not share one id")
    _require(all(c.get("object") == ("chat.completion.chunk" if chat else "text_completion") for c in chunks),
             "a chunk with the wrong object")
    _require(all(len(c.get("choices", [])) == 1 for c in chunks), "a content chunk without exactly one choice")
    _require(all(("usage" in c) == job.include_usage for c in chunks), "usage keys do not follow include_usage")
    reasons = [c["choices"][0].get("finish_reason") for c in chunks]
    _require(reasons[-1] is not None and all(r is None for r in reasons[:-1]),
             f"finish_reason must be set on the last chunk only: {reasons}")
    if chat:
        deltas = [c["choices"][0]["delta"] for c in chunks]
        _require(deltas[0].get("role") == "assistant" and all("role" not in d for d in deltas[1:]),
                 "the role must be announced in the first chunk only")
        text = "".join(d.get("content", "") for d in deltas)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    token_texts: list[str] = []
    best: list[dict[str, float]] = []
    for chunk in chunks:
        chunk_tokens, chunk_best = _token_logprobs(job, chunk["choices"][0].get("logprobs"))
        _require(len(chunk_tokens) >= 1 or chunk is chunks[-1], "a content chunk without a token")
        token_texts += chunk_tokens
        best += chunk_best
    # At least one token per chunk (outputs the server could not stream at once go out merged): the logprobs
    # count them, and usage must agree.
    tokens = len(token_texts)
    _require(len(chunks) <= max(tokens, 1), f"{len(chunks)} chunks for {tokens} tokens")
    if usage is not None:
        _require(_check_usage(job, usage) == tokens, f"usage says {usage['completion_tokens']} tokens, "
                                                    f"the stream's logprobs {tokens}")
    _check_length(job, tokens, reasons[-1])
    return Answer(text, tokens, reasons[-1], tuple(token_texts), tuple(best))
