"""What the engine hands back to its callers, one object per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """A snapshot of one request after an engine step.

    `new_token_ids` / `delta_text` / `new_logprobs` hold what this step added; `text` and
    `token_ids` hold everything generated so far. `text` never contains a matched stop string.
    `token_ids` is the request's own list, which later steps extend (copied per step it would cost every
    running request its whole output each step): copy it to keep this step's view.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    delta_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
