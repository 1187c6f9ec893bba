"""Tool calling over HTTP on a random-weight model with a hermes-format chat template: calls the grammar enforces
("required", a named function) always parse and match their tool's schema; calls the model writes in its own
format ("auto") are read back by the parser, streamed or not; tool-call history renders through the template."""

from __future__ import annotations

import functools

import httpx
import pytest

from tests.helpers.chat import TIME, WEATHER, check_calls, post_chat, stream_chat, user

# What a hermes model writes when it calls a tool; forced here with a regex, since the weights are random.
HERMES_CALL = r'Let me check\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'


_chat = functools.partial(post_chat, defaults=dict(messages=user("Weather in Paris?"), max_tokens=150,
                                                  tools=[WEATHER, TIME]))


def test_required_calls_always_parse_and_match_their_schemas(byte_http, byte_server):
    # A random model adds calls to the array at a coin's toss: room for a few.
    response = _chat(byte_http, tool_choice="required", n=5, temperature=1.0, seed=7, max_tokens=800)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        assert choice["message"]["tool_calls"]
        check_calls(choice["message"]["tool_calls"])
    assert byte_server.all_blocks_free()


def test_required_without_parallel_calls_makes_exactly_one(byte_http):
    response = _chat(byte_http, tool_choice="required", parallel_tool_calls=False, n=4, temperature=1.0, seed=2)
    for choice in response.json()["choices"]:
        assert len(choice["message"]["tool_calls"]) == 1
        check_calls(choice["message"]["tool_calls"])


def test_a_named_function_is_called_with_valid_arguments(byte_http):
    response = _chat(byte_http, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0,
                     seed=4)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # as OpenAI: a forced function is not the model's choice to call
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    check_calls([call])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_are_the_same_calls(byte_http, tool_choice):
    content, _, calls, reason = stream_chat(byte_http, tool_choice=tool_choice, temperature=1.0, seed=9, max_tokens=800)
    assert content == ""
    assert calls
    check_calls(calls)
    assert reason == ("tool_calls" if tool_choice == "required" else "stop")


def test_auto_reads_the_models_own_tool_call_format(byte_http):
    response = _chat(byte_http, structured_outputs={"regex": HERMES_CALL}, temperature=1.0, seed=1)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    check_calls([call])
    content, _, calls, reason = stream_chat(byte_http, structured_outputs={"regex": HERMES_CALL}, temperature=1.0,
                                            seed=1)
    assert (content, reason) == ("Let me check.", "tool_calls")
    assert [c["function"] for c in calls] == [call["function"]]


def test_auto_without_a_call_answers_in_text(byte_http):
    response = _chat(byte_http, structured_outputs={"choice": ["It is sunny."]})
    choice = response.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(byte_http):
    messages = [{"role": "user", "content": "hi"}]
    with_tools = byte_http.post("/tokenize", json={"model": "tiny", "messages": messages, "tools": [WEATHER]}).json()
    without = byte_http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert with_tools["count"] > without["count"]
    response = _chat(byte_http, tool_choice="none", max_tokens=3, messages=messages)
    assert response.json()["usage"]["prompt_tokens"] == without["count"]


def test_tool_call_history_renders_through_the_template(byte_http, byte_server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    tokens = byte_http.post("/tokenize",
                            json={"model": "tiny", "messages": messages, "return_token_strs": False}).json()
    prompt = byte_http.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json()["prompt"]
    # The arguments reach the template as an object: written once as JSON, not as a quoted string.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\n18 degrees" in prompt
    response = _chat(byte_http, messages=messages, tool_choice="none", max_tokens=4)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "'required'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "no room"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "letters"),
    ({"messages": [{"role": "tool", "content": "18"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "needs content"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
])
def test_tool_requests_that_cannot_work_are_400s(byte_http, body, param, words):
    response = _chat(byte_http, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


def test_a_tokenizer_the_grammar_cannot_read_is_named(client):
    # The word-level tiny model's template shows no tool format, so its calls would be read in the generic
    # format, which its grammar enforces; its word-level vocabulary cannot spell JSON.
    from openai import BadRequestError

    for choice in ("auto", "required"):
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}],
                                           tools=[WEATHER], tool_choice=choice, max_tokens=60)
        assert "tokenizer" in str(refused.value)


@pytest.fixture(scope="module")
def unparsed_http(server):
    """The word-level server's engine behind an app started with --tool-call-parser none."""
    from shardserve.entrypoints.openai.chat_output import ChatParsers
    from shardserve.entrypoints.openai.server import build_app
    from tests.serving import serve_in_thread

    with serve_in_thread(build_app(server.engine, "tiny", chat_parsers=ChatParsers("none"))) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def test_auto_with_no_tool_call_parser_names_the_flag(unparsed_http):
    response = _chat(unparsed_http, messages=[{"role": "user", "content": "w5"}])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in response.json()["error"]["message"]


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_a_tool_schema_the_grammar_cannot_enforce_is_named_whatever_the_tool_choice(byte_http, choice):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    response = _chat(byte_http, tools=[WEATHER, bad], tool_choice=choice)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools[1].function.parameters"
    assert "uniqueItems" in error["message"] and "'f'" in error["message"]


def test_history_with_null_or_missing_content_renders(byte_http):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    for assistant in ({"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "assistant", "tool_calls": [call]}):
        messages = [{"role": "user", "content": "Weather?"}, assistant,
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
        response = _chat(byte_http, messages=messages, max_tokens=4)
        assert response.status_code == 200, response.text
