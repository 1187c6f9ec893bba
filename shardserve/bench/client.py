"""One streamed request to an OpenAI-compatible server, timed on arrival of each chunk.

Requests ask for `usage` in the stream (`stream_options.include_usage`) so token counts are the
server's own, and send `ignore_eos` (vLLM's and shardserve's extension; others ignore it) so every
request generates its full `max_tokens`. A request fails on a non-200 answer, an `error` event in the
stream, or a transport error; its message is kept and the run goes on.

The client runs on aiohttp, whose C parser reads a stream chunk in about half the CPU time of httpx's pure
Python one (38 against 76 us, docs/benchmarks-notebook.md): at 512 streams one process must read a
chunk for every stream within each engine step, or the figures measure the client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from shardserve.bench.workload import BenchRequest

_ERROR_TEXT_LIMIT = 300


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `sent_s` is relative to the start of its level.

    Each chunk that carries output counts as an arrival: the first one ends the time to first token, the
    gaps between later ones are the inter-token latencies.
    """

    sent_s: float
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a request of fewer than two tokens."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


class OpenAIClient:
    """Sends BenchRequests to `base_url` (with or without a trailing /v1) as `model`."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float) -> None:
        self.model = model
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=30)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:  # made inside the running event loop
            # No pool limit: the concurrency gate decides how many requests are in flight.
            self._session = aiohttp.ClientSession(self.root, headers=self.headers, timeout=self.timeout,
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def spec_counters(self) -> dict[str, float] | None:
        """The server's speculative-decoding counters from /metrics (shardserve:spec_decode_num_{drafts,draft_tokens,
        accepted_tokens}), summed over models; None where /metrics does not answer or has none."""
        try:
            async with self._http().get("/metrics") as response:
                if response.status != 200:
                    return None
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        counters: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            key = family.name.removeprefix("shardserve:spec_decode_num_")
            if key != family.name:
                counters[key] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        return counters or None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, request: BenchRequest, level_start: float) -> RequestResult:
        path, body = self._body(request)
        started = time.perf_counter()
        result = RequestResult(sent_s=started - level_start)
        try:
            async with self._http().post(path, json=body) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {_error_text(await response.read())}"
                else:
                    await self._read_stream(response, started, result)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            kind = "timed out" if isinstance(e, asyncio.TimeoutError) else type(e).__name__
            result.error = f"{kind}: {e}" if str(e) else kind
        result.e2e_s = time.perf_counter() - started
        result.ok = result.error is None
        return result

    def _body(self, request: BenchRequest) -> tuple[str, dict]:
        body = {"model": self.model, "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if request.is_chat:
            return "/v1/chat/completions", {**body, "messages": request.messages}
        return "/v1/completions", {**body, "prompt": request.prompt}

    async def _read_stream(self, response: aiohttp.ClientResponse, started: float, result: RequestResult) -> None:
        last_arrival: float | None = None
        chunks_with_output = 0
        async for payload in _event_payloads(response):
            if payload == b"[DONE]":
                break
            try:
                chunk = json.loads(payload)
            except ValueError:
                result.error = (f"the stream sent something that is not JSON: "
                                f"{payload[:_ERROR_TEXT_LIMIT].decode(errors='replace')!r}")
                return
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                result.error = f"error in the stream: {_message(chunk)}"
                return
            if _carries_output(chunk):
                now = time.perf_counter()
                if last_arrival is None:
                    result.ttft_s = now - started
                else:
                    result.itl_s.append(now - last_arrival)
                last_arrival = now
                chunks_with_output += 1
            if usage := chunk.get("usage"):
                result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                result.completion_tokens = int(usage.get("completion_tokens") or 0)
                result.usage_reported = True
        if not result.usage_reported:
            result.completion_tokens = chunks_with_output  # a server that ignores include_usage


async def _event_payloads(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The data of each `data:` line of a server-sent event stream, as it arrives."""
    pending = b""
    async for data in response.content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[len(b"data:"):].strip()


def _carries_output(chunk: dict) -> bool:
    """A completion chunk with a choice, or a chat chunk with content; not a chat stream's role-only
    opening chunk, which servers send together with the first token."""
    for choice in chunk.get("choices") or []:
        if "text" in choice or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _error_text(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        return _message(json.loads(text))
    except ValueError:
        return text.strip()[:_ERROR_TEXT_LIMIT] or "(empty body)"


def _message(payload) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`), or of vLLM's (`{"message": ...}`)."""
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:_ERROR_TEXT_LIMIT]
        if isinstance(error, str):
            return error[:_ERROR_TEXT_LIMIT]
    return json.dumps(payload)[:_ERROR_TEXT_LIMIT]
