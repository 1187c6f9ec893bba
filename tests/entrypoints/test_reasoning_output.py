"""A server started with --reasoning-parser splits what the model thinks into reasoning_content, in a response
and as its own stream deltas, before tool calls are read from the rest (the outputs are forced with a regex:
the weights are random)."""

from __future__ import annotations

import json

import pytest

from shardserve.entrypoints.openai.chat_output import ChatParsers
from tests.helpers.chat import WEATHER, chat_ok, stream_chat, user

THINKING = r"<think>\nThe user asks about (Paris|Rome)\.\n</think>\n\nIt is sunny\."
THINKING_THEN_CALL = (r'<think>\nI should call a tool\.\n</think>\n\n<tool_call>\n\{"name": "get_weather", '
                      r'"arguments": \{"city": "Rome", "unit": "celsius"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def http(byte_app_client):
    """The byte model's engine behind an app started with --reasoning-parser qwen3."""
    return byte_app_client(ChatParsers(reasoning_parser="qwen3"))


def _chat(http, **body):
    """The first choice of a chat request, by default "Weather?" sampled with seed 3."""
    return chat_ok(http, dict(messages=user("Weather?"), max_tokens=200, temperature=1.0, seed=3), **body)["choices"][0]


def test_reasoning_is_split_from_the_answer(http):
    choice = _chat(http, structured_outputs={"regex": THINKING})
    message = choice["message"]
    assert message["reasoning_content"] in ("The user asks about Paris.", "The user asks about Rome.")
    assert message["content"] == "It is sunny."
    assert choice["finish_reason"] == "stop"


def test_streamed_reasoning_comes_as_its_own_deltas(http):
    whole = _chat(http, structured_outputs={"regex": THINKING})["message"]
    content, reasoning, calls, reason = stream_chat(http, tools=None, temperature=1.0, seed=3, max_tokens=200,
                                                structured_outputs={"regex": THINKING})
    assert (reasoning, content, calls, reason) == (whole["reasoning_content"], whole["content"], [], "stop")


def test_tool_calls_are_read_after_the_reasoning(http):
    choice = _chat(http, tools=[WEATHER], structured_outputs={"regex": THINKING_THEN_CALL})
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I should call a tool."
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome", "unit": "celsius"}
    content, reasoning, calls, reason = stream_chat(http, tools=[WEATHER], temperature=1.0, seed=3, max_tokens=200,
                                                structured_outputs={"regex": THINKING_THEN_CALL})
    assert (reasoning, content, reason) == ("I should call a tool.", "", "tool_calls")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_an_answer_without_thinking_is_all_content(http):
    choice = _chat(http, structured_outputs={"choice": ["Just the answer."]})
    assert choice["message"] == {"role": "assistant", "content": "Just the answer."}
