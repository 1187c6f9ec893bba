"""Per-request sampling parameters, validated once when a request enters the engine."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

MAX_LOGPROBS = 20  # as OpenAI's top_logprobs and vLLM
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# What torch.Generator.manual_seed takes: any signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)


# What a structured output's `spec` holds, per kind: a JSON schema (JSON text), nothing (any JSON object), a
# regular expression, a JSON list of strings, a grammar in Lark or GBNF syntax.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint every generated token must keep: the output stays a prefix of a string of the language,
    and ends when the language does (engine/grammar.py compiles it)."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives (0-20) to report per sampled token
    # Logits processing, applied on the device to every row that asks for it, in this order: logit_bias,
    # min_tokens, the three penalties, then temperature, min_p, top-k and top-p. Reported logprobs are those of
    # the model's own distribution, before any of it.
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    min_tokens: int = 0  # eos and stop_token_ids cannot be sampled (and stop strings do not match) before this
    repetition_penalty: float = 1.0  # tokens of the prompt or the output: logit / p if positive, * p if not
    presence_penalty: float = 0.0  # subtracted from the logit of each token present in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    min_p: float = 0.0  # tokens below min_p x the best token's probability are dropped
    structured: StructuredOutput | None = None  # tokens the grammar does not allow get -inf, after the above
    skip_special_tokens: bool = True  # the text leaves out special tokens
    include_stop_str_in_output: bool = False  # the text ends with the stop string that ended it
    # False: no text is decoded (outputs carry token ids, text stays ""), e.g. for benchmarks that
    # send token ids. Stop strings need the text, so they are refused then.
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, between {SEED_RANGE[0]} and {SEED_RANGE[1]}, "
                             f"got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {token_id}: {bias}")
        if self.structured is not None and self.min_tokens > 0:
            raise ValueError("min_tokens cannot be combined with a structured output: the grammar decides where "
                             "the output ends")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {list(self.stop)!r} need the generated text, but detokenize is False: "
                             f"set detokenize=True, or stop on token ids with stop_token_ids")

    # The properties below are read for every sequence of every step: each is computed once (the fields are frozen;
    # the cached values live outside the fields, so equality, hashing and msgspec encoding ignore them).
    @functools.cached_property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @functools.cached_property
    def penalized(self) -> bool:
        """Whether sampling reads the tokens so far (the penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property
    def needs_last_token(self) -> bool:
        """Whether sampling depends on the previous token on the host (a grammar must accept it), so no step can
        be queued before that token is known. (The penalties count it where it is, on the device.)"""
        return self.structured is not None

    @functools.cached_property
    def processes_logits(self) -> bool:
        """Whether any logits processing other than temperature, top-k and top-p applies."""
        return (bool(self.logit_bias) or self.min_tokens > 0 or self.penalized or self.min_p > 0
                or self.structured is not None)
