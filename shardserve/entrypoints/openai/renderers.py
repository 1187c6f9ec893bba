"""Response bodies built from engine outputs: one renderer per endpoint (completions, chat).

A renderer turns each `RequestOutput` into a stream chunk, a run's usage into the final usage
chunk, and the finished choices into the complete JSON response; it knows nothing of transport.

The pydantic models of protocol.py define every body. Stream chunks, one per output of every request in
flight, are also written directly (`chunk_event`): the parts that never change within a request (id, object,
created, model) are encoded once, and only the choice is encoded per output, with msgspec. Both must give the
same JSON (tests/entrypoints/test_renderers.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec
from pydantic import BaseModel

from shardserve.entrypoints.openai.chat_output import ChatOutput, ChoiceStreamer
from shardserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionLogprobsFormatter,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    TokenText,
    UsageInfo,
    chat_logprobs,
)
from shardserve.entrypoints.openai.tools import ToolCallOut
from shardserve.requests.outputs import RequestOutput, TokenLogprob


class Renderer(Protocol):
    """Turns engine outputs into one endpoint's response bodies."""

    request_id: str

    def chunk(self, output: RequestOutput, index: int = 0) -> BaseModel: ...

    def chunk_event(self, output: RequestOutput, include_usage: bool, index: int = 0) -> bytes:
        """The server-sent event of `chunk(output, index)`, with `"usage": null` when include_usage."""
        ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response_choices(self, results: list[tuple[RequestOutput, list[TokenLogprob]]],
                         usage: UsageInfo) -> BaseModel:
        """The whole response: choice i is results[i] (its final output and every token's logprobs)."""
        ...


class _FirstChunks:
    """Which choices' first chunk has gone out (it carries what only the first does: the role, the echo)."""

    __slots__ = ("_sent",)

    def __init__(self) -> None:
        self._sent: set[int] = set()

    def first(self, index: int) -> bool:
        """Whether the chunk about to go out for choice `index` is its first."""
        first = index not in self._sent
        self._sent.add(index)
        return first


_encode = msgspec.json.Encoder().encode


class _ChunkFrame:
    """A stream chunk's event with everything but its choice encoded once per request."""

    __slots__ = ("_head", "_tail")

    def __init__(self, model: BaseModel, include_usage: bool) -> None:
        fixed = _encode(model.model_dump(mode="json", include={"id", "object", "created", "model"}))
        self._head = b"data: " + fixed[:-1] + b',"choices":['
        self._tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def event(self, choice: dict[str, Any]) -> bytes:
        return self._head + _encode(choice) + self._tail


class CompletionRenderer:
    """`echo`: choice index -> the prompt text that choice's text starts with (completions' echo)."""

    def __init__(self, request_id: str, model: str, token_text: TokenText, with_logprobs: bool,
                 echo: dict[int, str] | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self._token_text = token_text
        self._with_logprobs = with_logprobs
        self._formatters: dict[int, CompletionLogprobsFormatter] = {}  # per choice: offsets continue per choice
        self._echo = dict(echo or {})  # each choice's first chunk, and its whole text, start with its prompt
        self._started = _FirstChunks()
        self._frame: _ChunkFrame | None = None

    def _echoed(self, index: int) -> str:
        """The prompt text a stream chunk of choice `index` starts with: its echo in the first, else nothing."""
        return self._echo.get(index, "") if self._started.first(index) else ""

    def _format(self, logprobs: list[TokenLogprob] | None, index: int) -> CompletionLogprobs | None:
        if not self._with_logprobs:
            return None
        formatter = self._formatters.setdefault(index, CompletionLogprobsFormatter(self._token_text))
        return formatter.format(logprobs or [])

    def chunk(self, output: RequestOutput, index: int = 0) -> CompletionStreamResponse:
        choice = CompletionChoice(index=index, text=self._echoed(index) + output.delta_text,
                                  logprobs=self._format(output.new_logprobs, index),
                                  finish_reason=output.finish_reason if output.finished else None)
        return CompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])

    def chunk_event(self, output: RequestOutput, include_usage: bool, index: int = 0) -> bytes:
        if self._frame is None:
            self._frame = _ChunkFrame(CompletionStreamResponse(id=self.request_id, model=self.model, choices=[]),
                                      include_usage)
        logprobs = self._format(output.new_logprobs, index)
        return self._frame.event({"index": index, "text": self._echoed(index) + output.delta_text,
                                  "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
                                  "finish_reason": output.finish_reason if output.finished else None})

    def usage_chunk(self, usage: UsageInfo) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response_choices(self, results: list[tuple[RequestOutput, list[TokenLogprob]]],
                         usage: UsageInfo) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text=self._echo.get(i, "") + final.text,
                                    logprobs=self._format(logprobs, i), finish_reason=final.finish_reason)
                   for i, (final, logprobs) in enumerate(results)]
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=usage)


class ChatRenderer:
    """`output`: how the text becomes a message (chat_output.py); None: the text is the content."""

    def __init__(self, request_id: str, model: str, token_text: TokenText, with_logprobs: bool,
                 output: ChatOutput | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self._token_text = token_text
        self._with_logprobs = with_logprobs
        self._output = output if output is not None and not output.is_plain else None
        self._streamers: dict[int, ChoiceStreamer] = {}
        self._started = _FirstChunks()
        self._frame: _ChunkFrame | None = None

    def chunk(self, output: RequestOutput, index: int = 0) -> ChatCompletionStreamResponse:
        if self._output is not None:
            choice = ChatCompletionStreamChoice.model_validate(self._shaped_choice(output, index))
            return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])
        # Each choice's first chunk announces the speaker, as OpenAI's streams do.
        delta = DeltaMessage(role="assistant" if self._started.first(index) else None, content=output.delta_text)
        choice = ChatCompletionStreamChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(output.new_logprobs or []),
            finish_reason=output.finish_reason if output.finished else None,
        )
        return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])

    def chunk_event(self, output: RequestOutput, include_usage: bool, index: int = 0) -> bytes:
        if self._frame is None:
            self._frame = _ChunkFrame(ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[]),
                                      include_usage)
        if self._output is not None:
            choice = self._shaped_choice(output, index)
            if not choice["delta"] and choice["finish_reason"] is None and choice["logprobs"] is None:
                return b""  # text held back (a marker's start, a tool call being written): nothing to say yet
            return self._frame.event(choice)
        # As DeltaMessage serializes: the parts that are set.
        delta = {"role": "assistant", "content": output.delta_text} if self._started.first(index) else {
            "content": output.delta_text}
        logprobs = self._logprobs(output.new_logprobs or [])
        return self._frame.event({"index": index, "delta": delta,
                                  "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
                                  "finish_reason": output.finish_reason if output.finished else None})

    def _shaped_choice(self, output: RequestOutput, index: int) -> dict[str, Any]:
        """A stream choice, as JSON, of a response whose text is shaped into reasoning, content and tool calls."""
        streamer = self._streamers.get(index)
        if streamer is None:
            streamer = self._streamers[index] = self._output.streamer()
        delta = streamer.delta(output.delta_text, output.finished)
        if self._started.first(index):
            delta = {"role": "assistant", **delta}
        logprobs = self._logprobs(output.new_logprobs or [])
        reason = self._output.finish_reason(output.finish_reason, streamer.called_tools) if output.finished else None
        return {"index": index, "delta": delta,
                "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"), "finish_reason": reason}

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response_choices(self, results: list[tuple[RequestOutput, list[TokenLogprob]]],
                         usage: UsageInfo) -> ChatCompletionResponse:
        choices = []
        for i, (final, logprobs) in enumerate(results):
            message, reason = ChatResponseMessage(content=final.text), final.finish_reason
            if self._output is not None:
                parts = self._output.message(final.text)
                message = ChatResponseMessage(content=parts.content, reasoning_content=parts.reasoning,
                                              tool_calls=[ToolCallOut.of(c) for c in parts.tool_calls])
                reason = self._output.finish_reason(reason, bool(parts.tool_calls))
            choices.append(ChatCompletionChoice(index=i, message=message, logprobs=self._logprobs(logprobs),
                                                finish_reason=reason))
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(logprobs, self._token_text) if self._with_logprobs else None
