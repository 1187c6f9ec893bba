"""A server started with --reasoning-parser splits what the model thinks into reasoning_content, in a response
and as its own stream deltas, before tool calls are read from the rest (the outputs are forced with a regex:
the weights are random)."""

from __future__ import annotations

import json

import pytest

from shardserve.entrypoints.openai.chat_output import ChatParsers
from tests.entrypoints.test_tool_calling import WEATHER, _stream
from tests.serving import serve_model

THINKING = r"<think>\nThe user asks about (Paris|Rome)\.\n</think>\n\nIt is sunny\."
THINKING_THEN_CALL = (r'<think>\nI should call a tool\.\n</think>\n\n<tool_call>\n\{"name": "get_weather", '
                      r'"arguments": \{"city": "Rome", "unit": "celsius"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def http(byte_model_dir):
    with serve_model(byte_model_dir, name="tiny", max_model_len=2048, kv_cache_memory_gb=0.05,
                     chat_parsers=ChatParsers(reasoning_parser="qwen3")) as running, running.http() as client:
        yield client


def _chat(http, **body):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200,
            "temperature": 1.0, "seed": 3, **body}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_reasoning_is_split_from_the_answer(http):
    choice = _chat(http, structured_outputs={"regex": THINKING})
    message = choice["message"]
    assert message["reasoning_content"] in ("The user asks about Paris.", "The user asks about Rome.")
    assert message["content"] == "It is sunny."
    assert choice["finish_reason"] == "stop"


def test_streamed_reasoning_comes_as_its_own_deltas(http):
    whole = _chat(http, structured_outputs={"regex": THINKING})["message"]
    content, reasoning, calls, reason = _stream(http, tools=None, temperature=1.0, seed=3, max_tokens=200,
                                                structured_outputs={"regex": THINKING})
    assert (reasoning, content, calls, reason) == (whole["reasoning_content"], whole["content"], [], "stop")


def test_tool_calls_are_read_after_the_reasoning(http):
    choice = _chat(http, tools=[WEATHER], structured_outputs={"regex": THINKING_THEN_CALL})
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I should call a tool."
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome", "unit": "celsius"}
    content, reasoning, calls, reason = _stream(http, tools=[WEATHER], temperature=1.0, seed=3, max_tokens=200,
                                                structured_outputs={"regex": THINKING_THEN_CALL})
    assert (reasoning, content, reason) == ("I should call a tool.", "", "tool_calls")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_an_answer_without_thinking_is_all_content(http):
    choice = _chat(http, structured_outputs={"choice": ["Just the answer."]})
    assert choice["message"] == {"role": "assistant", "content": "Just the answer."}
