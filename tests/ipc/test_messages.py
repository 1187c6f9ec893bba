"""The channel's messages survive the wire exactly, and a message that is not one of them is refused."""

from __future__ import annotations

import msgspec
import pytest

from shardserve.ipc.messages import (
    Abort,
    AddRequest,
    Call,
    CallReply,
    Failure,
    Outputs,
    Sleep,
    Status,
    ToCore,
    ToFrontend,
    TokenOutput,
    WakeUp,
)
from shardserve.requests.client import EngineStats
from shardserve.requests.outputs import TokenLogprob
from shardserve.requests.sampling_params import SamplingParams


def _roundtrip(message, kind):
    return msgspec.msgpack.Decoder(kind).decode(msgspec.msgpack.Encoder().encode(message))


def test_requests_and_calls_reach_the_core_unchanged():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=2**63 + 5,
                            stop_token_ids=(1, 2), ignore_eos=True, logprobs=2, detokenize=False)
    for message in (AddRequest(1, "cmpl-1", [5, 6, 7], params), Abort(["a", "b"]), Call(0, 3, WakeUp(True, False)),
                    Call(1, 4, Sleep(2))):
        assert _roundtrip(message, ToCore) == message


def test_outputs_status_and_failures_reach_the_front_end_unchanged():
    lp = TokenLogprob(4, -0.25, [(4, -0.25), (9, -1.5)])
    stats = EngineStats(1, 2, 100, 90, 0, 3, 1, False, 1, 1, 0.4, restarts=2)
    for message in (Outputs([TokenOutput("r", [4], [lp], False, None), TokenOutput("s", [1, 2], None, True, "stop")]),
                    Failure("r", "invalid", "prompt token id 99 is outside the vocabulary [0, 50)"),
                    CallReply(3, None), Status(True, {"restarts": 0}, False, stats, 2048),
                    Status(False, {}, True, None, 2048)):
        assert _roundtrip(message, ToFrontend) == message


def test_sampling_params_are_validated_when_they_arrive():
    data = msgspec.msgpack.encode(AddRequest(0, "x", [1], SamplingParams()))
    bad = data.replace(msgspec.msgpack.encode("temperature") + msgspec.msgpack.encode(1.0),
                       msgspec.msgpack.encode("temperature") + msgspec.msgpack.encode(-1.0))
    assert bad != data
    with pytest.raises(msgspec.ValidationError, match="temperature must be >= 0"):
        msgspec.msgpack.Decoder(ToCore).decode(bad)


def test_a_message_of_another_kind_is_refused():
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(ToCore).decode(msgspec.msgpack.encode(CallReply(1, None)))


def test_a_call_carries_only_a_command_the_engine_knows():
    data = msgspec.msgpack.encode(Call(0, 1, Sleep(1))).replace(b"Sleep", b"Sleeq")
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(ToCore).decode(data)
