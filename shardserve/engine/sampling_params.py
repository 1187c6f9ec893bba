"""Per-request sampling parameters, validated once when a request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 5
# What torch.Generator.manual_seed takes: any signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)


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
    logprobs: int | None = None  # number of top alternatives (0-5) to report per sampled token
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
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {list(self.stop)!r} need the generated text, but detokenize is False: "
                             f"set detokenize=True, or stop on token ids with stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
