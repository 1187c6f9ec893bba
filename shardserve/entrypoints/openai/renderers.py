"""Response bodies built from engine outputs: one renderer per endpoint (completions, chat).

A renderer turns each `RequestOutput` into a stream chunk, a run's usage into the final usage
chunk, and a finished request into the complete JSON response; it knows nothing of transport.
"""

from __future__ import annotations

from typing import Protocol

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

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob]) -> BaseModel: ...


def usage_of(output: RequestOutput) -> UsageInfo:
    """The token counts of the request `output` belongs to, as of that output."""
    return UsageInfo.of(output.num_prompt_tokens, output.num_output_tokens)


class CompletionRenderer:
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
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage_of(final))


class ChatRenderer:
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
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage_of(final))

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(logprobs, self._token_text) if self._with_logprobs else None
