"""The OpenAI-compatible endpoints against EchoEngine, which answers with the prompt's own text."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

import shardserve

if TYPE_CHECKING:
    from conftest import LiveServer

MODEL = "echo-model"
# The test tokenizer's chat template renders this conversation as the text below, which
# EchoEngine then generates back.
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
RENDERED = "system: Be brief.\nuser: Hi\nassistant: "


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a server-sent event stream, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == ""
    assert all(block.startswith("data: ") for block in blocks[:-1])
    return [block.removeprefix("data: ") for block in blocks[:-1]]


# --------------------------------------------------------------------------- completions


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=50)
    assert completion.id.startswith("cmpl-") and len(completion.id) == len("cmpl-") + 32
    assert completion.object == "text_completion" and completion.model == MODEL
    [choice] = completion.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, "Hello world", "stop", None)
    # 11 characters plus BOS in; 11 characters out.
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (12, 11)
    assert completion.usage.total_tokens == 23


def test_completion_stops_at_max_tokens(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == ("Hell", "length")
    assert completion.usage.completion_tokens == 4


def test_default_max_tokens_is_the_rest_of_the_context(client: openai.OpenAI, server: LiveServer) -> None:
    completion = client.completions.create(model=MODEL, prompt="abc", extra_body={"ignore_eos": True})
    rest = server.engine.max_model_len - 4
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == rest
    assert completion.choices[0].text == ("abc" * rest)[:rest]


def test_prompt_forms(client: openai.OpenAI, tokenizer) -> None:
    ids = tokenizer.encode("Hello")
    for prompt in (["Hello"], ids, [ids], ids[1:]):
        completion = client.completions.create(model=MODEL, prompt=prompt)
        assert completion.choices[0].text == "Hello"


def test_parameters_reach_the_engine(client: openai.OpenAI, server: LiveServer) -> None:
    client.completions.create(
        model=MODEL,
        prompt="Hello world",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=42,
        stop=["zz"],
        extra_body={"top_k": 3, "stop_token_ids": [5], "ignore_eos": True},
    )
    [(prompt_ids, params)] = server.engine.submitted.values()
    assert prompt_ids == server.engine.tokenizer.encode("Hello world")
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (7, 0.5, 0.9, 3, 42)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.logprobs) == (("zz",), (5,), True, None)


def test_stop_string_and_stop_token(client: openai.OpenAI, tokenizer) -> None:
    by_string = client.completions.create(model=MODEL, prompt="Hello world", stop="o w")
    assert (by_string.choices[0].text, by_string.choices[0].finish_reason) == ("Hell", "stop")
    space = tokenizer.encode(" ", add_special_tokens=False)
    by_token = client.completions.create(model=MODEL, prompt="Hello world", extra_body={"stop_token_ids": space})
    assert (by_token.choices[0].text, by_token.choices[0].finish_reason) == ("Hello", "stop")


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    body = {"prompt": "Hi", "frobnicate": True, "metadata": {"a": 1}, "presence_penalty": 0, "logit_bias": {}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "Hi"


def test_model_may_be_omitted(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi"})
    assert response.json()["model"] == MODEL


def test_completion_logprobs(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Hey you", logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == "Hey you"
    assert logprobs.token_logprobs == [-0.25] * 7
    assert logprobs.text_offset == [0, 1, 2, 3, 4, 5, 6]
    assert all(len(top) == 3 and top[token] == -0.25 for token, top in zip(logprobs.tokens, logprobs.top_logprobs))


# --------------------------------------------------------------------------- chat


def test_chat_completion(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    [choice] = chat.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", RENDERED, "stop")
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(RENDERED) + 1, len(RENDERED))


def test_chat_content_parts_and_developer_role(client: openai.OpenAI, server: LiveServer) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=messages)
    assert chat.choices[0].message.content == "system: Be brief.\nuser: H\ni\nassistant: "


def test_chat_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=6)
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("system", "length")
    assert chat.usage.completion_tokens == 6


def test_chat_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["s", "y", "s"]
    first = content[0]
    assert (first.logprob, first.bytes) == (-0.25, [ord("s")])
    assert [top.token for top in first.top_logprobs][0] == "s" and len(first.top_logprobs) == 2
    assert all(top.bytes == list(top.token.encode()) for top in first.top_logprobs)


def test_chat_logprobs_without_alternatives(client: openai.OpenAI, server: LiveServer) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert [entry.top_logprobs for entry in chat.choices[0].logprobs.content] == [[], []]
    [(_, params)] = server.engine.submitted.values()
    assert params.logprobs == 0


# --------------------------------------------------------------------------- streaming


def test_completion_stream_matches_non_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Streaming works", max_tokens=12)
    chunks = list(client.completions.create(model=MODEL, prompt="Streaming works", max_tokens=12, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text == "Streaming wo"
    assert [chunk.choices[0].finish_reason for chunk in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_chat_stream_matches_non_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:])
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_raw_stream_framing(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True, "max_tokens": 4})
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [chunk["choices"][0]["delta"] for chunk in chunks] == [
        {"role": "assistant", "content": "sy"},
        {"content": "st"},
    ]
    assert all("usage" not in chunk for chunk in chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_usage(http: httpx.Client, path: str) -> None:
    body = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": MESSAGES}
    whole = http.post(path, json=body).json()
    streamed = http.post(path, json=body | {"stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(event) for event in sse_events(streamed)[:-1]]
    *content, last = chunks
    assert all(chunk["usage"] is None and len(chunk["choices"]) == 1 for chunk in content)
    assert last["choices"] == [] and last["usage"] == whole["usage"]


def test_stream_usage_through_the_client(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, max_tokens=5
        )
    )
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(RENDERED) + 1,
        5,
        len(RENDERED) + 6,
    )


def test_streamed_logprobs_continue_offsets(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="abcdef", logprobs=1, stream=True))
    offsets = [offset for chunk in chunks for offset in chunk.choices[0].logprobs.text_offset]
    assert offsets == [0, 1, 2, 3, 4, 5]


# --------------------------------------------------------------------------- client going away


def test_closed_stream_aborts_the_request(server: LiveServer) -> None:
    server.engine.step_delay = 0.02
    stream = server.openai().completions.create(
        model=MODEL, prompt="loop", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    stream.close()
    assert server.wait_for(lambda: first.id in server.engine.aborted)
    assert first.id not in server.engine.finished


def test_raw_stream_disconnect_aborts_the_request(server: LiveServer) -> None:
    server.engine.step_delay = 0.02
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 200, "ignore_eos": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        request_id = json.loads(next(response.iter_lines()).removeprefix("data: "))["id"]
    assert server.wait_for(lambda: request_id in server.engine.aborted)


def test_non_streamed_disconnect_aborts_the_request(server: LiveServer) -> None:
    server.engine.step_delay = 0.02
    body = {"prompt": "loop", "max_tokens": 200, "ignore_eos": True}
    with server.http(timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body)
    [request_id] = server.engine.submitted
    assert server.wait_for(lambda: request_id in server.engine.aborted)


def test_finished_requests_are_not_aborted(client: openai.OpenAI, server: LiveServer) -> None:
    client.completions.create(model=MODEL, prompt="Hi")
    list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert len(server.engine.finished) == 2 and not server.engine.aborted


# --------------------------------------------------------------------------- models, health, version


def test_models(client: openai.OpenAI, http: httpx.Client, server: LiveServer) -> None:
    [model] = client.models.list().data
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "shardserve")
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list"
    assert listing["data"][0]["max_model_len"] == server.engine.max_model_len


def test_health(http: httpx.Client, server: LiveServer) -> None:
    assert http.get("/health").status_code == 200
    server.engine.healthy = False
    response = http.get("/health")
    assert response.status_code == 503 and "not running" in response.json()["error"]["message"]


def test_version(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": shardserve.__version__}
