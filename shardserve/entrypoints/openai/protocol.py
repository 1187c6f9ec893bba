"""Request and response bodies of the OpenAI-compatible API.

Requests are validated strictly (a string is not an integer, `1` is not `true`) and reject
features the engine does not implement instead of silently ignoring them; fields no model
here declares are ignored, as OpenAI does. Validators normalise the flexible OpenAI shapes
(`stop` as string or list, content as string or parts) so handlers see one form only; the
OpenAPI schema (`/openapi.json`) documents the shapes a client may send, not the normalised one.

Everything a request carries is checked here, before it reaches the engine: numbers are finite,
integers fit the 64-bit fields they end up in, and text is valid Unicode (JSON's `\ud800` escapes
can smuggle in unpaired surrogates, which neither the tokenizer nor UTF-8 accepts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
)

from shardserve.engine.outputs import TokenLogprob
from shardserve.engine.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams

TokenText = Callable[[int], str]


def _now() -> int:
    return int(time.time())


# --------------------------------------------------------------------------- requests

# Token ids: anything past this is out of every vocabulary, and rejected before it could overflow a tensor.
MAX_TOKEN_ID = 2**31 - 1


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text, but character {exc.start} is an unpaired surrogate "
                         f"({value[exc.start]!r})") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_RequestModel):
    include_usage: bool | None = False


class GenerationRequest(_RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)  # None: the rest of the context
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    # A string or a list of strings; validated as a list.
    stop: Annotated[list[Text] | None, WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]})] = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: Text | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_in_range(cls, value: list[int] | None) -> list[int] | None:
        bad = next((t for t in value or () if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise ValueError(f"token ids must be between 0 and {MAX_TOKEN_ID}, got {bad}")
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only n=1 is supported, got n={value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value:
            raise ValueError(f"{info.field_name} is not supported; only 0 is accepted, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream should end with a chunk carrying token usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field `requested_max_tokens` comes from, to name in errors."""
        return "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives to report per generated token (0: only the sampled one); None: no logprobs."""
        return None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError (from SamplingParams) for values out of range."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.num_logprobs,
        )


def _reject_if_set(name: str, value: Any, unsupported: Callable[[Any], bool]) -> Any:
    if unsupported(value):
        raise ValueError(f"{name} is not supported, got {value!r}")
    return value


class CompletionRequest(GenerationRequest):
    # One prompt per request: a string or a list of token ids (a one-element batch is unwrapped).
    prompt: Annotated[str | list[int], WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}, "minItems": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
    ]})]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        # Checked here rather than by the annotation, so an error names `prompt`, not a branch of the union.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            return _valid_unicode(value)
        if isinstance(value, list) and all(type(t) is int for t in value):
            if not value:
                raise ValueError("prompt must not be empty")
            bad = next((t for t in value if not 0 <= t <= MAX_TOKEN_ID), None)
            if bad is not None:
                raise ValueError(f"token ids must be between 0 and {MAX_TOKEN_ID}, got {bad}")
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        raise ValueError("prompt must be a string, a list of one string, or a list of token ids")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        return _reject_if_set("echo", value, bool)

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _reject_if_set("best_of", value, lambda v: v is not None and v != 1)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _reject_if_set("suffix", value, bool)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(_RequestModel):
    role: Annotated[Literal["system", "user", "assistant"], WithJsonSchema(
        {"type": "string", "enum": ["system", "developer", "user", "assistant"]})]
    # A string or a list of text parts, joined into one string by the validator.
    content: Annotated[Text, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"]}}]})]

    @field_validator("role", mode="before")
    @classmethod
    def _developer_is_system(cls, value: Any) -> Any:
        # Newer OpenAI clients send system instructions under the "developer" role.
        return "system" if value == "developer" else value

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text' field")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        return _reject_if_set("tools", value, bool)

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _reject_if_set("response_format", value, lambda v: v is not None and v.get("type") != "text")

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name of the same limit; it wins when both are set.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages in the shape the tokenizer's chat template takes."""
        return [{"role": m.role, "content": m.content} for m in self.messages]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# --------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length"]


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_parts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A delta lists only what it changes; the closing chunk's delta is `{}`, as OpenAI sends it.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "shardserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None  # the request field at fault, e.g. "messages[0].role"; None: the request as a whole
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (errors.py builds them)."""

    error: ErrorInfo


# --------------------------------------------------------------------------- logprobs


class CompletionLogprobsFormatter:
    """Renders engine logprobs in the legacy completions format.

    `text_offset` counts characters from the start of the completion (the prompt is never
    echoed); the running offset lives here so that stream chunks continue where the
    previous chunk ended.
    """

    def __init__(self, token_text: TokenText) -> None:
        self._token_text = token_text
        self._offset = 0

    def format(self, logprobs: list[TokenLogprob]) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for entry in logprobs:
            text = self._token_text(entry.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            # Distinct ids that render to the same text share a key; the better one is kept.
            top: dict[str, float] = {}
            for token_id, logprob in entry.top:
                top.setdefault(self._token_text(token_id), logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(self._offset)
            self._offset += len(text)
        return result


def chat_logprobs(logprobs: list[TokenLogprob], token_text: TokenText) -> ChatLogprobs:
    """Renders engine logprobs in the chat format; `bytes` is the UTF-8 of the token's text."""

    def describe(token_id: int) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **describe(entry.token_id),
                logprob=entry.logprob,
                top_logprobs=[ChatTopLogprob(**describe(t), logprob=lp) for t, lp in entry.top],
            )
            for entry in logprobs
        ]
    )
