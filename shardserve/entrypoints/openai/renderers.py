"""Response bodies built from engine outputs: one renderer per endpoint (completions, chat).

A renderer turns each `RequestOutput` into a stream chunk, a run's usage into the final usage
chunk, and a finished request into the complete JSON response; it knows nothing of transport.

The pydantic models of protocol.py define every body. Stream chunks, one per output of every request in
flight, are also written directly (`chunk_event`): the parts that never change within a request (id, object,
created, model) are encoded once, and only the choice is encoded per output, with msgspec. Both must give the
same JSON (tests/entrypoints/test_renderers.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec
from pydantic import BaseModel

from shardserve.engine.outputs import RequestOutput, TokenLogprob
from shardserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobsFormatter,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    TokenText,
    UsageInfo,
    chat_logprobs,
)


class Renderer(Protocol):
    """Turns engine outputs into one endpoint's response bodies."""

    request_id: str

    def chunk(self, output: RequestOutput) -> BaseModel: ...

    def chunk_event(self, output: RequestOutput, include_usage: bool) -> bytes:
        """The server-sent event of `chunk(output)`, with `"usage": null` when include_usage."""
        ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob]) -> BaseModel: ...


def usage_of(output: RequestOutput) -> UsageInfo:
    """The token counts of the request `output` belongs to, as of that output."""
    return UsageInfo.of(output.num_prompt_tokens, output.num_output_tokens)


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
    def __init__(self, request_id: str, model: str, token_text: TokenText, with_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self._logprobs = CompletionLogprobsFormatter(token_text) if with_logprobs else None
        self._frame: _ChunkFrame | None = None

    def _choice(self, text: str, logprobs: list[TokenLogprob] | None, output: RequestOutput) -> CompletionChoice:
        return CompletionChoice(
            text=text,
            logprobs=self._logprobs.format(logprobs or []) if self._logprobs else None,
            finish_reason=output.finish_reason if output.finished else None,
        )

    def chunk(self, output: RequestOutput) -> CompletionStreamResponse:
        choice = self._choice(output.delta_text, output.new_logprobs, output)
        return CompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])

    def chunk_event(self, output: RequestOutput, include_usage: bool) -> bytes:
        if self._frame is None:
            self._frame = _ChunkFrame(CompletionStreamResponse(id=self.request_id, model=self.model, choices=[]),
                                      include_usage)
        logprobs = None
        if self._logprobs is not None:
            logprobs = self._logprobs.format(output.new_logprobs or []).model_dump(mode="json")
        return self._frame.event({"index": 0, "text": output.delta_text, "logprobs": logprobs,
                                  "finish_reason": output.finish_reason if output.finished else None})

    def usage_chunk(self, usage: UsageInfo) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob]) -> CompletionResponse:
        choice = self._choice(final.text, logprobs, final)
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage_of(final))


class ChatRenderer:
    def __init__(self, request_id: str, model: str, token_text: TokenText, with_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self._token_text = token_text
        self._with_logprobs = with_logprobs
        self._role_sent = False
        self._frame: _ChunkFrame | None = None

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

    def chunk_event(self, output: RequestOutput, include_usage: bool) -> bytes:
        if self._frame is None:
            self._frame = _ChunkFrame(ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[]),
                                      include_usage)
        # As DeltaMessage serializes: the parts that are set.
        delta = {"content": output.delta_text} if self._role_sent else {"role": "assistant",
                                                                         "content": output.delta_text}
        self._role_sent = True
        logprobs = self._logprobs(output.new_logprobs or [])
        return self._frame.event({"index": 0, "delta": delta,
                                  "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
                                  "finish_reason": output.finish_reason if output.finished else None})

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob]) -> ChatCompletionResponse:
        choice = ChatCompletionChoice(
            message=ChatResponseMessage(content=final.text),
            logprobs=self._logprobs(logprobs),
            finish_reason=final.finish_reason,
        )
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage_of(final))

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(logprobs, self._token_text) if self._with_logprobs else None
