"""What crosses between the front ends and the engine core, as typed msgpack messages (msgspec; never pickle).

Front end -> core: `AddRequest`, `Abort`, `Call` (a `Sleep` or a `WakeUp`), on one PUSH/PULL channel shared by
all front ends; `Abort`, `Sleep` and `WakeUp` are the engine loop's own commands (requests/commands.py).
Core -> front end i: `Outputs` (every output of one engine step that belongs to front end i, in one message),
`Failure` (one request ended with an error), `CallReply`, and `Status` (health, sleep state and engine
statistics, sent every STATUS_INTERVAL_S and after every sleep or wake), on front end i's own channel.

Only token ids cross: the front end tokenizes, detokenizes and matches stop strings itself.
"""

from __future__ import annotations

import msgspec

from shardserve.requests.client import EngineStats
from shardserve.requests.commands import Abort, EngineCall, Sleep, WakeUp
from shardserve.requests.outputs import TokenLogprob
from shardserve.requests.sampling_params import SamplingParams

STATUS_INTERVAL_S = 0.25


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    frontend: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Call(msgspec.Struct, tag=True, array_like=True):
    frontend: int
    call_id: int
    command: EngineCall


class TokenOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None


class Outputs(msgspec.Struct, tag=True, array_like=True):
    items: list[TokenOutput]


class Failure(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    kind: str  # one of FAILURE_KINDS
    message: str


class CallReply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    failure_kind: str | None  # None: the call succeeded
    message: str = ""


class Status(msgspec.Struct, tag=True, array_like=True):
    healthy: bool
    details: dict
    sleeping: bool
    stats: EngineStats | None  # None while no engine is running (a restart)
    max_model_len: int


# Why a request or a call failed: a refused request (a 400), a dead engine (a 500), a server that stops (a 503).
FAILURE_KINDS = ("invalid", "dead", "shutting_down", "error")

ToCore = AddRequest | Abort | Call
ToFrontend = Outputs | Failure | CallReply | Status

__all__ = ["STATUS_INTERVAL_S", "FAILURE_KINDS", "AddRequest", "Abort", "Call", "Sleep", "WakeUp", "TokenOutput",
           "Outputs", "Failure", "CallReply", "Status", "ToCore", "ToFrontend"]
