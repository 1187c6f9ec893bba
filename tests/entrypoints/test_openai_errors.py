"""Every way a request can fail gets the right status and an OpenAI-shaped error naming the problem.

All of it runs against the real engine, except the engine failures (500), which need a failure injected.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from shardserve.tokenizer import Tokenizer
from tests.entrypoints.conftest import API_KEY, MODEL, SIMULATED_FAILURE, SMALL_BODY_LIMIT, EngineSpy
from tests.serving import InProcessServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "w10 w11 w12"
USER_MESSAGES = [{"role": "user", "content": PROMPT}]


def error_of(response: httpx.Response, status: int) -> dict:
    """The `error` object of a failed response, after checking its status and shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def words(n: int) -> str:
    """A prompt of exactly `n` tokens (one per word; the tokenizer adds no BOS)."""
    return " ".join(["w7"] * n)


def greedy_text(client: openai.OpenAI, prompt: str = PROMPT, max_tokens: int = 4) -> str:
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == max_tokens
    return completion.choices[0].text


# --------------------------------------------------------------------------- invalid parameters (400)


def test_wrong_type_for_max_tokens(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens="ten")  # type: ignore[arg-type]
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "max_tokens"
    assert "max_tokens" in error["message"] and "integer" in error["message"]


def test_negative_temperature(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER_MESSAGES, temperature=-1)
    assert info.value.body["param"] == "temperature"
    assert "temperature" in info.value.body["message"] and "-1" in info.value.body["message"]


@pytest.mark.parametrize("top_p", [0, 1.5])
def test_top_p_out_of_range(client: openai.OpenAI, top_p: float) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, top_p=top_p)
    assert info.value.body["param"] == "top_p"
    assert "top_p" in info.value.body["message"]


@pytest.mark.parametrize("n", [0, 129])
def test_choices_out_of_range(client: openai.OpenAI, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER_MESSAGES, n=n)
    assert info.value.body["param"] == "n"
    assert "between 1 and 128" in info.value.body["message"]


def test_invalid_json(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, content=b'{"prompt": "w10",', headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(response, 400)["message"]


def test_body_that_is_not_an_object(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, json=[PROMPT])
    assert "JSON object" in error_of(response, 400)["message"]


def test_empty_body(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, headers={"content-type": "application/json"})
    assert "empty" in error_of(response, 400)["message"]


def test_body_without_json_content_type(http: httpx.Client) -> None:
    response = http.post(COMPLETIONS, content=json.dumps({"prompt": PROMPT}), headers={"content-type": "text/plain"})
    assert "application/json" in error_of(response, 400)["message"]


def test_missing_required_field(http: httpx.Client) -> None:
    error = error_of(http.post(COMPLETIONS, json={"max_tokens": 3}), 400)
    assert error["param"] == "prompt"
    assert "Missing required parameter: 'prompt'" in error["message"]


def test_empty_messages(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert info.value.body["param"] == "messages"
    assert "at least one message" in info.value.body["message"]


def test_unknown_role(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": PROMPT}, {"role": "wizard", "content": "w13"}]
    error = error_of(http.post(CHAT, json={"messages": messages}), 400)
    assert error["param"] == "messages[1].role"
    assert "wizard" in error["message"] and "'user'" in error["message"]
    assert "'developer'" in error["message"], "developer is accepted, so the error lists it"


def test_non_text_content_part(http: httpx.Client) -> None:
    content = [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]
    error = error_of(http.post(CHAT, json={"messages": [{"role": "user", "content": content}]}), 400)
    assert error["param"] == "messages[0].content"
    assert "image_url" in error["message"]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty"),
        (CHAT, {"frequency_penalty": -3}, "frequency_penalty"),
        (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
        (CHAT, {"min_p": 1.5}, "min_p"),
        (CHAT, {"logit_bias": {"w7": 1}}, "logit_bias"),
        (CHAT, {"logit_bias": {"7": 101}}, "logit_bias"),
        (COMPLETIONS, {"echo": True, "logprobs": 1}, "echo"),
        (COMPLETIONS, {"best_of": 1, "n": 2}, "best_of"),
        (COMPLETIONS, {"best_of": 3, "stream": True}, "best_of"),
        (CHAT, {"echo": True}, "echo"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"stop": ["ok", ""]}, "stop"),
        (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids"),
        (COMPLETIONS, {"top_k": -2}, "top_k"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"seed": 1.5}, "seed"),
        (COMPLETIONS, {"stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": ["w10", []]}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [10, -5]}, "prompt"),
        # This model's template shows no tool-call format: the generic format's grammar cannot spell with its words.
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"continue_final_message": True}, "continue_final_message"),
        (CHAT, {"max_completion_tokens": "many"}, "max_completion_tokens"),
    ],
)
def test_unsupported_or_invalid_parameter(http: httpx.Client, path: str, extra: dict, param: str) -> None:
    body = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": USER_MESSAGES}
    error = error_of(http.post(path, json=body | extra), 400)
    assert error["param"] == param
    assert param in error["message"]


def test_prompt_longer_than_context(client: openai.OpenAI, server: InProcessServer, tokenizer: Tokenizer) -> None:
    limit = server.engine.max_model_len
    prompt = words(limit + 10)
    assert len(tokenizer.encode(prompt)) == limit + 10
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt)
    message = info.value.body["message"]
    assert f"maximum context length is {limit} tokens" in message
    assert f"{limit + 10} tokens" in message
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "prompt"


def test_prompt_plus_max_tokens_longer_than_context(
    client: openai.OpenAI, server: InProcessServer, tokenizer: Tokenizer
) -> None:
    limit = server.engine.max_model_len
    prompt = words(limit - 10)
    assert len(tokenizer.encode(prompt)) == limit - 10
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    message = info.value.body["message"]
    assert f"maximum context length is {limit} tokens" in message
    assert f"you requested {limit + 10} tokens ({limit - 10} in the prompt, 20 for the completion)" in message
    greedy_text(client, prompt, max_tokens=10)  # exactly filling the context is allowed


def test_chat_prompt_longer_than_context(client: openai.OpenAI, server: InProcessServer) -> None:
    messages = [{"role": "user", "content": words(server.engine.max_model_len)}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert info.value.body["param"] == "messages"
    assert f"maximum context length is {server.engine.max_model_len} tokens" in info.value.body["message"]


def test_engine_refusal_is_a_bad_request(client: openai.OpenAI, engine_spy: EngineSpy) -> None:
    # Token id 9999 is past the tiny model's 1000-word vocabulary: the engine refuses the prompt.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[10, 9999], max_tokens=3)
    message = info.value.body["message"]
    assert "9999" in message and "outside the vocabulary" in message
    assert info.value.body["type"] == "invalid_request_error"
    assert not engine_spy.added and not engine_spy.aborted  # refused before it was scheduled
    assert greedy_text(client)  # and the engine keeps serving


# --------------------------------------------------------------------------- model, auth, size


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt=PROMPT)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-17" in error["message"] and f"'{MODEL}'" in error["message"]


def test_unknown_path(http: httpx.Client) -> None:
    error = error_of(http.get("/v1/engines"), 404)
    assert "/v1/engines" in error["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {API_KEY}"}])
def test_missing_api_key(secured_server: InProcessServer, headers: dict) -> None:
    with httpx.Client(base_url=secured_server.url, headers=headers, timeout=30) as http:
        for method, path in [("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/nowhere")]:
            error = error_of(http.request(method, path, json={"prompt": PROMPT}), 401)
            assert "API key" in error["message"]


def test_wrong_api_key(secured_server: InProcessServer) -> None:
    wrong = openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=MODEL, prompt=PROMPT)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert "sk-wrong" not in info.value.body["message"]


def test_right_api_key(secured_server: InProcessServer, client: openai.OpenAI) -> None:
    # Same weights, same greedy request: the secured server answers as the open one does.
    assert greedy_text(secured_server.openai()) == greedy_text(client)


def test_probes_need_no_api_key(secured_server: InProcessServer) -> None:
    with secured_server.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").status_code == 200


def test_body_over_the_limit(small_body_server: InProcessServer) -> None:
    with small_body_server.http() as http:
        error = error_of(http.post(COMPLETIONS, json={"prompt": "w7 " * 700}), 413)
        assert str(SMALL_BODY_LIMIT) in error["message"] and "--max-request-body-mb" in error["message"]
        body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
        assert len(json.dumps(body)) < SMALL_BODY_LIMIT
        response = http.post(COMPLETIONS, json=body)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_chunked_body_over_the_limit(small_body_server: InProcessServer) -> None:
    def chunks():  # no Content-Length: the limit must be enforced while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"w7 " * 70
        yield b'"}'

    with small_body_server.http() as http:
        response = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
        assert str(SMALL_BODY_LIMIT) in error_of(response, 413)["message"]


def test_huge_body_with_default_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (5 * 2**20))
    assert info.value.status_code == 413


# --------------------------------------------------------------------------- engine failures (500)


def test_engine_failure_mid_generation(serve_failing: Callable[[int], InProcessServer]) -> None:
    failing = serve_failing(1)
    with pytest.raises(openai.InternalServerError) as info:
        failing.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, extra_body={"ignore_eos": True})
    assert info.value.status_code == 500
    assert SIMULATED_FAILURE in info.value.body["message"]
    assert info.value.body["type"] == "server_error"
    assert failing.all_blocks_free(), "the failed request kept its KV blocks"


def test_engine_failure_mid_stream(serve_failing: Callable[[int], InProcessServer], client: openai.OpenAI) -> None:
    request = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    healthy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    expected = "".join(chunk.choices[0].text for chunk in healthy)
    failing = serve_failing(2)
    with failing.http() as http:
        response = http.post(COMPLETIONS, json=request | {"stream": True})
    assert response.status_code == 200  # the stream had started
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert SIMULATED_FAILURE in error["message"] and error["type"] == "server_error"
    # The text generated before the failure reached the client (in as many chunks as the client's reads made of it:
    # outputs waiting for a slow reader go out merged), then the error.
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert streamed and expected.startswith(streamed), (streamed, expected)
    assert failing.all_blocks_free(), "the failed stream kept its KV blocks"


def test_server_survives_bad_input(http: httpx.Client) -> None:
    for body in [b"\xff\xfe", b"null", b"[]", b'{"prompt": {"a": 1}}', b'{"messages": "hi"}', b"9" * 5000]:
        assert http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}).status_code == 400
        assert http.post(CHAT, content=body, headers={"content-type": "application/json"}).status_code == 400
    response = http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(("path", "extra", "param"), [
    (CHAT, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"modalities": ["audio"]}, "modalities"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_a_known_field_that_would_change_the_output_is_refused_by_name(http: httpx.Client, path: str, extra: dict,
                                                                        param: str) -> None:
    body = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": USER_MESSAGES}
    error = error_of(http.post(path, json=body | extra), 400)
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert f"'{param}'" in error["message"] and "not supported" in error["message"]


def test_no_op_and_unknown_fields_are_accepted_and_unknown_ones_warned_once(http: httpx.Client, caplog) -> None:
    body = {"messages": USER_MESSAGES, "max_tokens": 2, "user": "u1", "store": False, "metadata": {"k": "v"},
            "service_tier": "auto", "parallel_tool_calls": True, "tool_choice": "none", "guided_json": None,
            "modalities": ["text"], "frobnicate_level": 3}
    with caplog.at_level("WARNING", logger="shardserve.entrypoints.openai.protocol"):
        for _ in range(2):
            assert http.post(CHAT, json=body).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "not known to this server" in r.getMessage()]
    assert len(warnings) == 1 and "frobnicate_level" in warnings[0]
