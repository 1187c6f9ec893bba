"""The generic tool format over HTTP on random weights (the byte model's engine, served with
--tool-call-parser generic): whatever a random model writes, the grammar keeps it to the format, so every call
parses and matches its tool's schema, every answer is text (or the response_format's object), and a stream
says what the whole response says."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest

from shardserve.entrypoints.openai.chat_output import ChatParsers
from tests.helpers.chat import SCHEMAS, TIME, WEATHER, chat_ok, check_calls, stream_chat, user


@pytest.fixture(scope="module")
def http(byte_app_client):
    return byte_app_client(ChatParsers("generic"))


_chat = functools.partial(chat_ok, defaults=dict(messages=user("Weather in Paris?"), max_tokens=200,
                                                tools=[WEATHER, TIME], temperature=1.0, seed=3))


def test_auto_either_calls_valid_tools_or_answers_in_text(http):
    kinds = set()
    for choice in _chat(http, n=6)["choices"]:
        message, reason = choice["message"], choice["finish_reason"]
        if message.get("tool_calls"):
            assert reason == "tool_calls" and message["content"] is None
            assert len(message["tool_calls"]) == 1  # parallel_tool_calls was not asked for
            check_calls(message["tool_calls"])
            kinds.add("call")
        else:
            assert reason in ("stop", "length") and isinstance(message["content"], str)
            assert not message["content"].startswith('{"response"')  # the envelope never reaches the client
            kinds.add("text")
    assert kinds, "no choice came back"


def test_required_and_parallel_calls_match_their_schemas(http):
    for choice in _chat(http, tool_choice="required", parallel_tool_calls=True, n=4, max_tokens=400)["choices"]:
        if choice["finish_reason"] == "length":
            continue  # a random model may leave its array open until the limit
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
        check_calls(choice["message"]["tool_calls"])


def test_a_named_function_is_the_one_called_and_finishes_with_stop(http):
    choice = _chat(http, tool_choice={"type": "function", "function": {"name": "get_time"}})["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and choice["finish_reason"] == "stop"
    check_calls([call])


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_stream_is_the_response_piece_by_piece(http, tool_choice):
    whole = _chat(http, tool_choice=tool_choice, seed=11)["choices"][0]
    content, _, calls, reason = stream_chat(http, tool_choice=tool_choice, seed=11, max_tokens=200,
                                        messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        temperature=1.0)
    assert reason == whole["finish_reason"]
    assert (content or None) == whole["message"]["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls") or []]


def test_auto_with_a_response_format_answers_in_its_schema_or_calls(http):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "warm": {"type": "boolean"}},
              "required": ["city", "warm"]}
    body = _chat(http, n=4, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    for choice in body["choices"]:
        if choice["message"].get("tool_calls"):
            check_calls(choice["message"]["tool_calls"])
        elif choice["finish_reason"] == "stop":
            answer = json.loads(choice["message"]["content"])
            jsonschema.validate(answer, schema)
            assert set(answer) == {"city", "warm"}


def test_auto_with_a_regex_response_format_is_a_400_naming_it(http):
    response = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "structured_outputs": {"regex": "[a-z]+"}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "structured_outputs.regex"
    assert "generic" in response.json()["error"]["message"]


def test_tokenize_renders_what_the_chat_request_sends(http):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    chat = _chat(http, messages=messages, max_tokens=2)
    tokens = http.post("/tokenize", json={"model": "tiny", "messages": messages, "tools": [WEATHER, TIME]}).json()
    assert chat["usage"]["prompt_tokens"] == tokens["count"]
    prompt = http.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json()["prompt"]
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]}' in prompt
    assert "18 degrees" in prompt and json.dumps(SCHEMAS["get_time"]) in prompt
