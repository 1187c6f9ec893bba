"""Stream chunks written directly (Renderer.chunk_event) are the JSON their pydantic models give."""

from __future__ import annotations

import json
import time

import pytest

from shardserve.entrypoints.openai.renderers import ChatRenderer, CompletionRenderer
from shardserve.requests.outputs import RequestOutput, TokenLogprob


def _token_text(token_id: int) -> str:
    return ["é", " a", "\"q\"", "\\n", "\u2028", "x"][token_id % 6]


def _outputs(with_logprobs: bool) -> list[RequestOutput]:
    texts = ["Hé", " \"quoted\"", "", "tab\t and \u2028 and \\", "end"]
    outs, ids = [], []
    for i, delta in enumerate(texts):
        ids.append(i)
        last = i == len(texts) - 1
        logprobs = [TokenLogprob(i, -0.25 * i - 1e-7, [(i, -0.5), (i + 1, -1.75)])] if with_logprobs else None
        outs.append(RequestOutput("req-1", [1, 2, 3], list(ids), "".join(texts[:i + 1]), [i], delta, logprobs,
                                  last, "length" if last else None))
    return outs


def _parsed(event: bytes | str) -> dict:
    text = event.decode() if isinstance(event, bytes) else event
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[len("data: "):])


@pytest.mark.parametrize("renderer_cls", [CompletionRenderer, ChatRenderer])
@pytest.mark.parametrize("with_logprobs", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_chunk_events_equal_the_models(renderer_cls, with_logprobs, include_usage):
    direct = renderer_cls("req-1", "the-model", _token_text, with_logprobs)
    reference = renderer_cls("req-1", "the-model", _token_text, with_logprobs)  # logprob offsets are stateful
    for output in _outputs(with_logprobs):
        got = _parsed(direct.chunk_event(output, include_usage))
        model = reference.chunk(output)
        want = json.loads(model.model_dump_json(exclude=None if include_usage else {"usage"}))
        assert abs(got.pop("created") - want.pop("created")) <= 2
        assert got == want
        if include_usage:
            assert "usage" in got and got["usage"] is None
        else:
            assert "usage" not in got


def test_chunk_events_of_one_request_share_id_and_created():
    renderer = ChatRenderer("req-7", "m", _token_text, False)
    first, *rest = [_parsed(renderer.chunk_event(o, False)) for o in _outputs(False)]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hé"}
    assert all(c["id"] == "req-7" and c["created"] == first["created"] for c in rest)
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    assert abs(first["created"] - time.time()) < 5
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
