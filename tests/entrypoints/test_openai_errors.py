"""Every way a request can fail gets the right status and an OpenAI-shaped error naming the problem."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from conftest import LiveServer

API_KEY = "sk-test-key"

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER_HI = [{"role": "user", "content": "Hi"}]


def error_of(response: httpx.Response, status: int) -> dict:
    """The `error` object of a failed response, after checking its status and shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --------------------------------------------------------------------------- invalid parameters (400)


def test_wrong_type_for_max_tokens(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="echo-model", prompt="Hi", max_tokens="ten")  # type: ignore[arg-type]
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "max_tokens"
    assert "max_tokens" in error["message"] and "integer" in error["message"]


def test_negative_temperature(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo-model", messages=USER_HI, temperature=-1)
    assert info.value.body["param"] == "temperature"
    assert "temperature" in info.value.body["message"] and "-1" in info.value.body["message"]


@pytest.mark.parametrize("top_p", [0, 1.5])
def test_top_p_out_of_range(client: openai.OpenAI, top_p: float) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="echo-model", prompt="Hi", top_p=top_p)
    assert info.value.body["param"] == "top_p"
    assert "top_p" in info.value.body["message"]


def test_more_than_one_choice(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo-model", messages=USER_HI, n=2)
    assert info.value.body["param"] == "n"
    assert "n=1" in info.value.body["message"]


def test_invalid_json(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, content=b'{"prompt": "Hi",', headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(response, 400)["message"]


def test_body_that_is_not_an_object(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, json=["Hi"])
    assert "JSON object" in error_of(response, 400)["message"]


def test_empty_body(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, headers={"content-type": "application/json"})
    assert "empty" in error_of(response, 400)["message"]


def test_body_without_json_content_type(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, content=json.dumps({"prompt": "Hi"}), headers={"content-type": "text/plain"})
    assert "application/json" in error_of(response, 400)["message"]


def test_missing_required_field(http: httpx.Client) -> None:
    error = error_of(http.post(COMPLETIONS, json={"max_tokens": 3}), 400)
    assert error["param"] == "prompt"
    assert "Missing required parameter: 'prompt'" in error["message"]


def test_empty_messages(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo-model", messages=[])
    assert info.value.body["param"] == "messages"
    assert "at least one message" in info.value.body["message"]


def test_unknown_role(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Abracadabra"}]
    error = error_of(http.post(CHAT, json={"messages": messages}), 400)
    assert error["param"] == "messages[1].role"
    assert "wizard" in error["message"] and "'user'" in error["message"]


def test_non_text_content_part(http: httpx.Client) -> None:
    content = [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]
    error = error_of(http.post(CHAT, json={"messages": [{"role": "user", "content": content}]}), 400)
    assert error["param"] == "messages[0].content"
    assert "image_url" in error["message"]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (COMPLETIONS, {"presence_penalty": 0.5}, "presence_penalty"),
        (CHAT, {"frequency_penalty": -1}, "frequency_penalty"),
        (COMPLETIONS, {"echo": True}, "echo"),
        (COMPLETIONS, {"logprobs": 6}, "logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 9}, "top_logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"stop": ["ok", ""]}, "stop"),
        (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids"),
        (COMPLETIONS, {"top_k": -2}, "top_k"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"seed": 1.5}, "seed"),
        (COMPLETIONS, {"stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [1, -5]}, "prompt"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"max_completion_tokens": "many"}, "max_completion_tokens"),
    ],
)
def test_unsupported_or_invalid_parameter(http: httpx.Client, path: str, extra: dict, param: str) -> None:
    body = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": USER_HI}
    error = error_of(http.post(path, json=body | extra), 400)
    assert error["param"] == param
    assert param in error["message"]


def test_prompt_longer_than_context(client: openai.OpenAI, server: LiveServer) -> None:
    limit = server.engine.max_model_len
    prompt = "x" * (limit + 10)  # one token per character, plus BOS
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="echo-model", prompt=prompt)
    message = info.value.body["message"]
    assert f"maximum context length is {limit} tokens" in message
    assert f"{limit + 11} tokens" in message
    assert info.value.body["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_longer_than_context(client: openai.OpenAI, server: LiveServer) -> None:
    limit = server.engine.max_model_len
    prompt = "x" * (limit - 11)  # limit - 10 tokens with BOS
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="echo-model", prompt=prompt, max_tokens=20)
    message = info.value.body["message"]
    assert f"maximum context length is {limit} tokens" in message
    assert f"you requested {limit + 10} tokens ({limit - 10} in the prompt, 20 for the completion)" in message


def test_chat_prompt_longer_than_context(client: openai.OpenAI, server: LiveServer) -> None:
    messages = [{"role": "user", "content": "y" * server.engine.max_model_len}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo-model", messages=messages, max_tokens=5)
    assert info.value.body["param"] == "messages"
    assert f"maximum context length is {server.engine.max_model_len} tokens" in info.value.body["message"]


def test_engine_refusal_is_a_bad_request(client: openai.OpenAI, server: LiveServer) -> None:
    server.engine.refusal = "token id 9999 is outside the vocabulary"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="echo-model", prompt=[9999])
    assert "outside the vocabulary" in info.value.body["message"]
    assert not server.engine.aborted


# --------------------------------------------------------------------------- model, auth, size


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="Hi")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-17" in error["message"] and "echo-model" in error["message"]


def test_unknown_path(http: httpx.Client) -> None:
    error = error_of(http.get("/v1/engines"), 404)
    assert "/v1/engines" in error["message"]


@pytest.fixture
def secured(start_server) -> LiveServer:
    return start_server(api_key=API_KEY)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {API_KEY}"}])
def test_missing_api_key(secured: LiveServer, headers: dict) -> None:
    with secured.http(headers=headers) as http:
        for method, path in [("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/nowhere")]:
            error = error_of(http.request(method, path, json={"prompt": "Hi"}), 401)
            assert "API key" in error["message"]


def test_wrong_api_key(secured: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        secured.openai(api_key="sk-wrong").completions.create(model="echo-model", prompt="Hi")
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert "sk-wrong" not in info.value.body["message"]


def test_right_api_key(secured: LiveServer) -> None:
    completion = secured.openai().completions.create(model="echo-model", prompt="Hi")
    assert completion.choices[0].text == "Hi"


def test_probes_need_no_api_key(secured: LiveServer) -> None:
    with secured.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").status_code == 200


def test_body_over_the_limit(start_server) -> None:
    server = start_server(max_body_bytes=1024)
    with server.http() as http:
        error = error_of(http.post(COMPLETIONS, json={"prompt": "x" * 2000}), 413)
        assert "1024" in error["message"]
        assert http.post(COMPLETIONS, json={"prompt": "x" * 100}).status_code == 200


def test_chunked_body_over_the_limit(start_server) -> None:
    server = start_server(max_body_bytes=1024)

    def chunks():  # no Content-Length: the limit must be enforced while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    with server.http() as http:
        response = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
        assert "1024" in error_of(response, 413)["message"]


def test_huge_body_with_default_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="echo-model", prompt="x" * (5 * 2**20))
    assert info.value.status_code == 413


# --------------------------------------------------------------------------- engine failures (500)


def test_engine_failure_mid_generation(client: openai.OpenAI, server: LiveServer) -> None:
    server.engine.fail_after_steps = 1
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="echo-model", prompt="Hello there")
    assert info.value.status_code == 500
    assert "simulated engine failure" in info.value.body["message"]
    assert info.value.body["type"] == "server_error"


def test_engine_failure_mid_stream(http: httpx.Client, server: LiveServer) -> None:
    server.engine.fail_after_steps = 2
    response = http.post(COMPLETIONS, json={"prompt": "Hello there", "stream": True})
    assert response.status_code == 200  # the stream had started
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "simulated engine failure" in error["message"]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == ["He", "ll"]


def test_server_survives_bad_input(http: httpx.Client) -> None:
    for body in [b"\xff\xfe", b"null", b"[]", b'{"prompt": {"a": 1}}', b'{"messages": "hi"}', b"9" * 5000]:
        assert http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}).status_code == 400
        assert http.post(CHAT, content=body, headers={"content-type": "application/json"}).status_code == 400
    assert http.post(COMPLETIONS, json={"prompt": "still here"}).json()["choices"][0]["text"] == "still here"
