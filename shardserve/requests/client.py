"""What the HTTP front end needs of an engine, declared once: `AsyncEngine` (the engine loop on a thread of
this process) and `Supervisor` (which restarts the ranks under it) both provide it.

Everything that crosses it is plain data (token ids, SamplingParams, RequestOutput, EngineStats), so an
engine in another process can stand behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shardserve.requests.outputs import RequestOutput
    from shardserve.requests.sampling_params import SamplingParams
    from shardserve.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine has stopped (failed, or its ranks died): requests in flight and new ones get a 500."""


class ServerShuttingDown(EngineDeadError):
    """The server is stopping (SIGINT/SIGTERM): requests in flight and new ones are refused with a 503."""


@dataclass(frozen=True)
class EngineStats:
    """The engine's state at one moment, as /metrics shows it."""

    running: int  # requests being computed
    waiting: int  # waiting to start, or for a wake
    kv_blocks_total: int
    kv_blocks_free: int  # free or held only by the prefix cache
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    sleeping: bool
    sleeps: int
    wakes: int
    last_wake_seconds: float
    restarts: int | None = None  # None: nothing restarts this engine
    # Speculative decoding: verified chunks, the tokens they proposed, and of those the ones accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: "Tokenizer"
    max_model_len: int

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: "SamplingParams") -> AsyncIterator["RequestOutput"]:
        """The request's outputs as the engine makes them; raises ValueError for a prompt it refuses."""

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def health_details(self) -> dict:
        """Shown by /health beside its status (restarts, the last failure)."""

    @property
    def is_sleeping(self) -> bool: ...

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None: ...

    def stats(self) -> EngineStats: ...

    def stop_accepting(self, reason: str) -> None:
        """The server stops: end the requests in flight with a 503 and refuse new ones."""

    def shutdown(self) -> None: ...
