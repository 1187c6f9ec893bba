"""What callers ask of an engine, as typed commands: start a request, abort requests, sleep, wake up.

The engine loop's queue (engine/async_engine.py) carries these, and the front ends' channel (ipc/messages.py)
carries the same structs to the engine core: `Abort` as it is, `Sleep` and `WakeUp` inside a `Call` (an `Add`
travels as an `AddRequest`, which also names the front end that sent it).
"""

from __future__ import annotations

import msgspec

from shardserve.requests.sampling_params import SamplingParams


class Add(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Abort these requests (a no-op for one that already ended); their streams get nothing more."""

    request_ids: list[str]


class Sleep(msgspec.Struct, tag=True, array_like=True):
    """Give the device memory back once no request is in flight (level 1 or 2, as LLMEngine.sleep takes it)."""

    level: int


class WakeUp(msgspec.Struct, tag=True, array_like=True):
    weights: bool = True
    kv_cache: bool = True


# The commands that answer when done (a sleep waits for the requests in flight).
EngineCall = Sleep | WakeUp
