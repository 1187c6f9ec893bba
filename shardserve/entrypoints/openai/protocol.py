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

import logging
import reprlib
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from shardserve.entrypoints.openai.constraints import ResponseFormat, StructuredOutputsParams
from shardserve.entrypoints.openai.fields import RequestModel, Text, valid_unicode
from shardserve.entrypoints.openai.tools import (
    ToolCallInMessage,
    ToolCallOut,
    ToolChoice,
    ToolDefinition,
    ToolPlan,
    template_tool_calls,
    tool_plan,
)
from shardserve.requests.outputs import TokenLogprob
from shardserve.requests.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SEED_RANGE, SamplingParams, StructuredOutput

logger = logging.getLogger(__name__)

TokenText = Callable[[int], str]


def _now() -> int:
    return int(time.time())


# --------------------------------------------------------------------------- requests

# Token ids: anything past this is out of every vocabulary, and rejected before it could overflow a tensor.
MAX_TOKEN_ID = 2**31 - 1
# Choices one request may ask for: n x the prompts of a batched completion request.
MAX_CHOICES = 128


def _token_ids_in_range(value: list[int] | None) -> list[int] | None:
    bad = next((t for t in value or () if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"token ids must be between 0 and {MAX_TOKEN_ID}, got {bad}")
    return value


_valid_unicode = valid_unicode
_RequestModel = RequestModel


# OpenAI's fields that change nothing a request computes here: accepted without a word.
NO_OP_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
_warned_unknown: set[str] = set()


def _warn_unknown_fields(model: type[BaseModel], data: Any) -> None:
    """Fields no model here declares are accepted (as vLLM does), with one warning per field name."""
    if not isinstance(data, dict):
        return
    for name in data:
        if name in model.model_fields or name in NO_OP_FIELDS or name in REFUSED_FIELDS:
            continue
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            logger.warning("request field %r is not known to this server and is ignored (warned once)", name)


# Fields this server knows and does not implement: each changes the output, so a request that sets one is
# refused with a 400 naming it rather than answered as if it had not been sent. The value is why.
_NOT_YET = "is not supported by this server yet"
REFUSED_FIELDS: dict[str, str] = {
    "guided_whitespace_pattern": "is not supported: the whitespace of structured JSON is fixed by this server "
                                 "(\", \" between items, \": \" after keys, nothing else)",
    "functions": "legacy function calling is not supported: send the functions as tools (each "
                 "{\"type\": \"function\", \"function\": {...}}) and function_call as tool_choice",
    "function_call": "legacy function calling is not supported: send tool_choice with tools instead",
    "reasoning_effort": _NOT_YET,
    "use_beam_search": "beam search " + _NOT_YET,
    "length_penalty": "beam search " + _NOT_YET,
    "prompt_logprobs": _NOT_YET,
    "bad_words": _NOT_YET,
    "allowed_token_ids": _NOT_YET,
    "truncate_prompt_tokens": _NOT_YET,
    "return_tokens_as_token_ids": _NOT_YET,
    "spaces_between_special_tokens": _NOT_YET,
    "audio": "audio output is not supported: this server answers in text only",
    "modalities": "output other than text is not supported: send [\"text\"] or leave it out",
}


def _is_set(name: str, value: Any) -> bool:
    """Whether a refused field asks for something (its defaults, and null, ask for nothing)."""
    if value is None or value is False:
        return False
    if name == "length_penalty":
        return value != 1
    if name == "spaces_between_special_tokens":
        return value is not True
    if name == "modalities":  # text is what every answer here is
        return value not in ([], ["text"])
    return not (isinstance(value, (list, dict, str)) and not value)


def _refuse_known_unsupported(data: Any) -> Any:
    if isinstance(data, dict):
        for name, why in REFUSED_FIELDS.items():
            if name in data and _is_set(name, data[name]):
                raise _Refused(name, why)
    return data


# Arguments of transformers' apply_chat_template that a template variable must not override.
TEMPLATE_CALL_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _template_variables_only(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs: variables of the template, none of which may stand for a rendering option."""
    clashing = sorted(set(value or {}) & TEMPLATE_CALL_ARGUMENTS)
    if clashing:
        raise ValueError(f"{', '.join(map(repr, clashing))} cannot be set here: chat_template_kwargs are "
                         f"variables of the chat template (such as enable_thinking), not rendering options")
    return value


def _template_options(add_generation_prompt: bool | None, continue_final_message: bool | None,
                      chat_template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None = None
                      ) -> dict[str, Any]:
    """How to render a conversation with the chat template (tokenizer.apply_chat_template)."""
    return {"add_generation_prompt": add_generation_prompt is not False, "tools": tools,
            "continue_final_message": bool(continue_final_message),
            "template_kwargs": dict(chat_template_kwargs or {})}


def _template_messages(messages: list["ChatMessage"]) -> list[dict[str, Any]]:
    """Messages in the shape the tokenizer's chat template takes."""
    return [m.for_template() for m in messages]


class _Refused(ValueError):
    """A known field this server does not implement; the handler turns it into a 400 with `param` = name."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.param = name
        self.why = why


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
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: int | None = Field(default=None, ge=0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    user: Text | None = None
    # Structured outputs (constraints.py): at most one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None  # which engine enforces a constraint changes no output: ignored

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        _warn_unknown_fields(cls, data)
        return _refuse_known_unsupported(data)

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
    def _stop_token_ids_in_range(cls, value: list[int] | None) -> list[int] | None:
        return _token_ids_in_range(value)

    @field_validator("n")
    @classmethod
    def _choices_in_range(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}, got {value}")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_to_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (as strings of digits), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bias} "
                                 f"for token {key}")
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

    def to_sampling_params(self, max_tokens: int, structured: StructuredOutput | None = None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) for values out of range."""
        return SamplingParams(
            structured=structured,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.num_logprobs,
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_p=self.min_p or 0.0,
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )


def _reject_if_set(name: str, value: Any, unsupported: Callable[[Any], bool]) -> Any:
    if unsupported(value):
        raise ValueError(f"{name} is not supported, got {value!r}")
    return value


def _one_prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return _valid_unicode(value)
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return _token_ids_in_range(value)
    if isinstance(value, list) and not value:
        raise ValueError("prompt must not be empty")
    raise ValueError("prompt must be a string, a list of token ids, or a list of either (a batch)")


class CompletionRequest(GenerationRequest):
    # A string or a list of token ids, or a batch of them (each prompt gets n choices, in prompt order).
    prompt: Annotated[list[str | list[int]], WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}, "minItems": 1},
        {"type": "array", "items": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}, "minItems": 1},
        ]}, "minItems": 1},
    ]})]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        # Checked here rather than by the annotation, so an error names `prompt`, not a branch of the union.
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            return [_one_prompt(p) for p in value]  # a batch
        return [_one_prompt(value)]

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs needs the prompt's logprobs, which this server does not "
                             "compute yet; send echo or logprobs")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value < n:
            raise ValueError(f"best_of must be at least n (the candidates the n returned are chosen from), got "
                             f"best_of={value} with n={n}")
        if value is not None and value > n and info.data.get("stream"):
            raise ValueError("best_of greater than n cannot be streamed: the best are known only once all finish")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _reject_if_set("suffix", value, bool)

    @model_validator(mode="after")
    def _choices_within_limit(self) -> "CompletionRequest":
        if len(self.prompt) * self.num_candidates > MAX_CHOICES:
            raise ValueError(f"{len(self.prompt)} prompts x {self.num_candidates} candidates (n, best_of) is more than "
                             f"{MAX_CHOICES} choices")
        return self

    @property
    def num_candidates(self) -> int:
        """Completions generated per prompt: best_of, of which the n with the highest cumulative logprob return."""
        return max(self.best_of or 1, self.num_choices)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# The roles a chat message may have; "developer" (newer OpenAI clients' name for system) is read as "system".
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(_RequestModel):
    role: Annotated[Literal["system", "user", "assistant", "tool"], WithJsonSchema(
        {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]})]
    tool_calls: list[ToolCallInMessage] | None = None  # an assistant message's calls (before content: read by
    # content's check)
    # A string or a list of text parts, joined into one string by the validator; None only for an assistant
    # message that calls tools.
    content: Annotated[Text | None, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"]}}, {"type": "null"}]})] = Field(default=None, validate_default=True)
    tool_call_id: Text | None = None  # a tool message: the call it answers
    name: Text | None = None
    reasoning_content: Text | None = None  # an earlier answer's reasoning: not shown to the template

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, value: Any) -> Any:
        if value not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(map(repr, CHAT_ROLES))}, got {reprlib.repr(value)}")
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

    @field_validator("content")
    @classmethod
    def _content_unless_calling_tools(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if value is None and not (role == "assistant" and info.data.get("tool_calls")):
            raise ValueError(f"a {role!r} message needs content (only an assistant message that calls tools may "
                             f"leave it null)")
        return value

    @model_validator(mode="after")
    def _calls_and_answers(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: null content as "" (templates concatenate it)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

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

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, value: Any) -> Any:
        # One message for every wrong shape, rather than one per member of the union.
        if value is None or value in ("none", "auto", "required") or isinstance(value, dict):
            return value
        raise ValueError(f"tool_choice is 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}, got {value!r}")

    def tool_plan(self, generic: bool = False, response_schema: dict[str, Any] | None = None) -> ToolPlan:
        """What the tools and tool_choice ask for (tools.tool_plan); ValueError when they do not fit together."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, generic, response_schema)

    @field_validator("echo")
    @classmethod
    def _no_chat_echo(cls, value: bool | None) -> bool | None:
        return _reject_if_set("echo", value, bool)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_variables_only(value)

    @field_validator("continue_final_message")
    @classmethod
    def _continue_an_assistant_message(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if not value:
            return value
        if info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message needs add_generation_prompt set to false: the final "
                             "message is continued, not answered")
        messages = info.data.get("messages") or []
        if messages and messages[-1].role != "assistant":
            raise ValueError(f"continue_final_message continues a final assistant message, but the final "
                             f"message's role is {messages[-1].role!r}")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name of the same limit; it wins when both are set.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_options(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        return _template_options(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs,
                                 tools)

    def chat_messages(self) -> list[dict[str, Any]]:
        return _template_messages(self.messages)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# --------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "tool_calls"]


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
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_absent_parts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # content is always there (null when the message only calls tools); the others only when they are.
        body = handler(self)
        if body.get("reasoning_content") is None:
            body.pop("reasoning_content", None)
        if not body.get("tool_calls"):
            body.pop("tool_calls", None)
        return body


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
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # tools.tool_call_delta entries

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


class TokenizeRequest(_RequestModel):
    """POST /tokenize (vLLM's shape): a completion `prompt`, or chat `messages` rendered with the template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # a prompt: default true; messages: the template places them
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None  # rendered into the prompt as the chat template does
    return_token_strs: bool | None = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_variables_only(value)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens applies to a prompt; with messages the chat template places "
                             "the special tokens")
        return self

    def template_options(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        return _template_options(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs,
                                 tools)

    def chat_messages(self) -> list[dict[str, Any]]:
        return _template_messages(self.messages)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_RequestModel):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]


class DetokenizeResponse(BaseModel):
    prompt: str


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
