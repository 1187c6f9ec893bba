"""The OpenAI-compatible endpoints in front of the real engine, driven with the real openai client."""

from __future__ import annotations

import json
import socket
from itertools import accumulate
from urllib.parse import urlsplit

import httpx
import openai
import pytest

import shardserve
from shardserve.tokenizer import Tokenizer
from tests.entrypoints.conftest import ENGINE_OPTIONS, MAX_MODEL_LEN, MODEL, TINY_MODEL, EngineSpy
from tests.serving import InProcessServer, serve_model, wait_until

PROMPT = "w10 w11 w12 w13"
MESSAGES = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]
# Long enough that a request cut short by its client cannot have finished on its own first, short
# enough to fit the context after PROMPT or MESSAGES.
LONG = 100


def complete(client: openai.OpenAI, prompt=PROMPT, max_tokens: int = 8, **extra):
    """A greedy completion that runs to `max_tokens` (EOS ignored), with `extra` body fields."""
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


def chat(client: openai.OpenAI, messages=MESSAGES, max_tokens: int = 8, **kwargs):
    """A greedy chat completion that runs to `max_tokens` (EOS ignored)."""
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True}, **kwargs)


def token_ids(tokenizer: Tokenizer, tokens: list[str]) -> list[int]:
    """The ids of tokens given as their text (every token of the tiny vocabulary has its own text)."""
    ids = [tokenizer.encode(token, add_special_tokens=False) for token in tokens]
    assert all(len(one) == 1 for one in ids), ids
    return [one[0] for one in ids]


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a server-sent event stream, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == ""
    assert all(block.startswith("data: ") for block in blocks[:-1])
    return [block.removeprefix("data: ") for block in blocks[:-1]]


# --------------------------------------------------------------------------- completions


def test_completion(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    completion = complete(client, max_tokens=8)
    assert completion.id.startswith("cmpl-") and len(completion.id) == len("cmpl-") + 32
    assert completion.object == "text_completion" and completion.model == MODEL
    [choice] = completion.choices
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "length", None)
    assert choice.text.strip() and choice.text.startswith("w")
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 8)
    assert completion.usage.total_tokens == prompt_tokens + 8
    # Greedy decoding is deterministic.
    assert complete(client, max_tokens=8).choices[0].text == choice.text


def test_completion_stops_at_max_tokens(client: openai.OpenAI) -> None:
    longer = complete(client, max_tokens=12).choices[0].text
    completion = complete(client, max_tokens=4)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4
    assert longer.startswith(completion.choices[0].text) and len(completion.choices[0].text) < len(longer)


def test_default_max_tokens_is_the_rest_of_the_context(client: openai.OpenAI, server: InProcessServer) -> None:
    rest = 40  # more than SamplingParams' own default, and than any fixed default that small
    prompt = " ".join(["w9"] * (server.engine.max_model_len - rest))
    completion = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == server.engine.max_model_len - rest
    assert completion.usage.completion_tokens == rest


def test_prompt_forms(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    expected = complete(client, PROMPT, max_tokens=6).choices[0].text
    for prompt in ([PROMPT], ids, [ids]):
        completion = complete(client, prompt, max_tokens=6)
        assert completion.choices[0].text == expected, prompt
        assert completion.usage.prompt_tokens == len(ids)


def test_parameters_reach_the_engine(client: openai.OpenAI, tokenizer: Tokenizer, engine_spy: EngineSpy) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=42,
        stop=["zz"],
        extra_body={"top_k": 3, "stop_token_ids": [5], "ignore_eos": True},
    )
    [(request_id, (prompt_ids, params))] = engine_spy.added.items()
    assert request_id == completion.id
    assert prompt_ids == tokenizer.encode(PROMPT)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (7, 0.5, 0.9, 3, 42)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.logprobs) == (("zz",), (5,), True, None)


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return complete(client, max_tokens=12, temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1  # 12 tokens drawn from 1000: seeds differ


def test_stop_string_and_stop_token(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    reference = complete(client, max_tokens=8, logprobs=0).choices[0]
    text, ids = reference.text, token_ids(tokenizer, reference.logprobs.tokens)

    stop = text.split()[2]  # the third word; it may first appear inside an earlier one
    by_string = complete(client, max_tokens=8, stop=stop).choices[0]
    assert (by_string.text, by_string.finish_reason) == (text[: text.index(stop)], "stop")

    stop_id = ids[2]
    by_token = complete(client, max_tokens=8, stop_token_ids=[stop_id]).choices[0]
    assert (by_token.text, by_token.finish_reason) == (tokenizer.decode(ids[: ids.index(stop_id)]), "stop")


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()
    extra = {"frobnicate": True, "metadata": {"a": 1}, "presence_penalty": 0, "logit_bias": {}}
    response = http.post("/v1/completions", json=body | extra)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == plain["choices"][0]["text"]


def test_model_may_be_omitted(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 200 and response.json()["model"] == MODEL


def test_completion_logprobs(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    choice = complete(client, max_tokens=6, logprobs=3).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert tokenizer.decode(token_ids(tokenizer, logprobs.tokens)) == choice.text
    assert logprobs.text_offset == [0, *accumulate(len(token) for token in logprobs.tokens[:-1])]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0
        assert len(top) == 3
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert next(iter(top)) == token and top[token] == pytest.approx(logprob)


# --------------------------------------------------------------------------- chat


def test_chat_completion(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    completion = chat(client, max_tokens=6)
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == MODEL
    [choice] = completion.choices
    assert (choice.message.role, choice.finish_reason, choice.logprobs) == ("assistant", "length", None)
    assert choice.message.content.strip()
    prompt_tokens = len(tokenizer.apply_chat_template(MESSAGES))
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 6)
    assert completion.usage.total_tokens == prompt_tokens + 6


def test_chat_content_parts_and_developer_role(
    client: openai.OpenAI, server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered: list[list[dict]] = []
    apply_chat_template = server.engine.tokenizer.apply_chat_template

    def recording(messages, **options):
        rendered.append(messages)
        return apply_chat_template(messages, **options)

    monkeypatch.setattr(server.engine.tokenizer, "apply_chat_template", recording)
    with_parts = [
        {"role": "developer", "content": [{"type": "text", "text": "w20 w21"}]},
        {"role": "user", "content": [{"type": "text", "text": "w30"}, {"type": "text", "text": "w31"}]},
    ]
    plain = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30\nw31"}]
    answer = chat(client, with_parts).choices[0].message.content
    assert rendered == [plain]  # developer is the system role; text parts are joined by newlines
    assert chat(client, plain).choices[0].message.content == answer


def test_chat_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    completion = chat(client, max_tokens=9, max_completion_tokens=6)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 6


def test_chat_logprobs(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    choice = chat(client, max_tokens=3, logprobs=True, top_logprobs=2).choices[0]
    content = choice.logprobs.content
    assert len(content) == 3
    assert tokenizer.decode(token_ids(tokenizer, [entry.token for entry in content])) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert all(top.bytes == list(top.token.encode()) for top in entry.top_logprobs)


def test_chat_logprobs_without_alternatives(client: openai.OpenAI, engine_spy: EngineSpy) -> None:
    completion = chat(client, max_tokens=2, logprobs=True)
    content = completion.choices[0].logprobs.content
    assert len(content) == 2 and all(entry.logprob <= 0 for entry in content)
    assert [entry.top_logprobs for entry in content] == [[], []]
    [(_, params)] = engine_spy.added.values()
    assert params.logprobs == 0


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("with_stop", [False, True])
def test_completion_stream_matches_non_streamed(client: openai.OpenAI, with_stop: bool) -> None:
    # A stop string makes the stream hold text back until it cannot be the start of the stop string.
    extra = {"stop": complete(client, max_tokens=12).choices[0].text.split()[5]} if with_stop else {}
    whole = complete(client, max_tokens=12, **extra)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, **extra}))
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    finish = "stop" if with_stop else "length"
    assert whole.choices[0].finish_reason == finish
    assert [chunk.choices[0].finish_reason for chunk in chunks] == [None] * (len(chunks) - 1) + [finish]
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_chat_stream_matches_non_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:])
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])


def test_raw_stream_framing(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/chat/completions", json=body).json()
    events = sse_events(http.post("/v1/chat/completions", json=body | {"stream": True}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    # One chunk per output; outputs that reach the server faster than it streams them go out merged.
    assert 1 <= len(chunks) <= 4
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert set(deltas[0]) == {"role", "content"} and deltas[0]["role"] == "assistant"
    assert all(set(delta) == {"content"} for delta in deltas[1:])
    assert "".join(delta["content"] for delta in deltas) == whole["choices"][0]["message"]["content"]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all("usage" not in chunk for chunk in chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_usage(http: httpx.Client, path: str) -> None:
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    body |= {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = http.post(path, json=body).json()
    streamed = http.post(path, json=body | {"stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(event) for event in sse_events(streamed)[:-1]]
    *content, last = chunks
    assert all(chunk["usage"] is None and len(chunk["choices"]) == 1 for chunk in content)
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 5


def test_stream_usage_through_the_client(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    chunks = list(chat(client, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    prompt_tokens = len(tokenizer.apply_chat_template(MESSAGES))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt_tokens,
        5,
        prompt_tokens + 5,
    )


def test_streamed_logprobs_continue_offsets(client: openai.OpenAI) -> None:
    whole = complete(client, max_tokens=6, logprobs=1).choices[0].logprobs
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert 1 <= len(chunks) <= 6  # outputs the server could not stream at once go out merged
    tokens = [token for chunk in chunks for token in chunk.choices[0].logprobs.tokens]
    offsets = [offset for chunk in chunks for offset in chunk.choices[0].logprobs.text_offset]
    assert tokens == whole.tokens
    assert offsets == whole.text_offset == [0, *accumulate(len(token) for token in tokens[:-1])]


# --------------------------------------------------------------------------- client going away


def test_closed_stream_aborts_the_request(server: InProcessServer, engine_spy: EngineSpy) -> None:
    stream = server.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    stream.close()
    assert wait_until(lambda: first.id in engine_spy.aborted), "the engine kept generating for a closed stream"
    assert server.all_blocks_free(), "the aborted request's KV blocks did not return to the pool"


def test_raw_stream_disconnect_aborts_the_request(server: InProcessServer, engine_spy: EngineSpy) -> None:
    body = {"messages": MESSAGES, "stream": True, "max_tokens": LONG, "ignore_eos": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        request_id = json.loads(next(response.iter_lines()).removeprefix("data: "))["id"]
    assert wait_until(lambda: request_id in engine_spy.aborted), "the engine kept generating after a disconnect"
    assert server.all_blocks_free(), "the aborted request's KV blocks did not return to the pool"


def test_a_closed_stream_of_several_choices_aborts_them_all(server: InProcessServer, engine_spy: EngineSpy) -> None:
    stream = server.openai().completions.create(
        model=MODEL, prompt=PROMPT, n=3, max_tokens=LONG, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    stream.close()
    ids = [first.id, f"{first.id}-1", f"{first.id}-2"]
    assert wait_until(lambda: all(i in engine_spy.aborted for i in ids)), "a choice kept generating"
    assert server.all_blocks_free(), "the aborted choices' KV blocks did not return to the pool"


def test_non_streamed_disconnect_aborts_the_request(server: InProcessServer, engine_spy: EngineSpy) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port)) as connection:
        connection.sendall(head + body)
        assert wait_until(lambda: engine_spy.added), "the request never reached the engine"
    # Hung up while the engine was generating.
    [request_id] = engine_spy.added
    assert wait_until(lambda: request_id in engine_spy.aborted), "the engine kept generating after a disconnect"
    assert server.all_blocks_free(), "the aborted request's KV blocks did not return to the pool"


def test_finished_requests_are_not_aborted(client: openai.OpenAI, engine_spy: EngineSpy) -> None:
    completion = complete(client, max_tokens=4)
    chunks = list(chat(client, max_tokens=4, stream=True))
    finished = {completion.id, chunks[0].id}
    assert finished <= set(engine_spy.added)
    assert completion.usage.completion_tokens == 4 and chunks[-1].choices[0].finish_reason == "length"
    assert not finished & set(engine_spy.abort_calls)


# --------------------------------------------------------------------------- models, health, version


def test_models(client: openai.OpenAI, http: httpx.Client) -> None:
    [model] = client.models.list().data
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "shardserve")
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list"
    assert listing["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_health(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_health_fails_once_the_engine_stops(tiny_model_dir) -> None:
    with serve_model(tiny_model_dir(TINY_MODEL), name=MODEL, **ENGINE_OPTIONS) as stopping, stopping.http() as http:
        assert http.get("/health").status_code == 200
        stopping.engine.shutdown()
        response = http.get("/health")
        assert response.status_code == 503 and "not running" in response.json()["error"]["message"]
        failed = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error" and "stopped" in failed.json()["error"]["message"]


def test_version(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": shardserve.__version__}


# --------------------------------------------------------------------------- models, tokenize, detokenize


def test_retrieve_the_served_model(client: openai.OpenAI, http: httpx.Client, server: InProcessServer) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == server.engine.max_model_len
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_a_prompt_and_a_conversation_as_the_server_counts_them(http: httpx.Client, tokenizer: Tokenizer
                                                                        ) -> None:
    body = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [tokenizer.token_text(t) for t in body["tokens"]]
    chat_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert chat_ids == tokenizer.apply_chat_template(MESSAGES)
    usage = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(chat_ids)
    both = http.post("/tokenize", json={"prompt": PROMPT, "messages": MESSAGES})
    assert both.status_code == 400 and "either prompt or messages" in both.json()["error"]["message"]


def test_detokenize(http: httpx.Client, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == tokenizer.decode(
        ids, skip_special_tokens=False)
    bad = http.post("/detokenize", json={"tokens": [tokenizer.vocab_size + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# --------------------------------------------------------------------------- chat template options


def test_chat_template_options_shape_the_prompt(http: httpx.Client, tokenizer: Tokenizer) -> None:
    def prompt_tokens(**extra) -> int:
        response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1} | extra)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(add_generation_prompt=False) == len(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False))
    continued = MESSAGES + [{"role": "assistant", "content": "w40 w41"}]
    assert prompt_tokens(messages=continued, add_generation_prompt=False, continue_final_message=True) == len(
        tokenizer.apply_chat_template(continued, add_generation_prompt=False, continue_final_message=True))
    clash = http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"
    assert "'tokenize'" in clash.json()["error"]["message"]


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, engine_spy: EngineSpy) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={"7": 3.5}, presence_penalty=0.5,
                              frequency_penalty=-0.25,
                              extra_body={"min_tokens": 2, "min_p": 0.1, "repetition_penalty": 1.2,
                                          "skip_special_tokens": False, "include_stop_str_in_output": True})
    [(_, (_, params))] = engine_spy.added.items()
    assert (params.min_tokens, params.min_p, params.repetition_penalty) == (2, 0.1, 1.2)
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.5, -0.25, ((7, 3.5),))
    assert params.skip_special_tokens is False and params.include_stop_str_in_output is True


# --------------------------------------------------------------------------- several choices


def test_n_choices_with_a_seed_are_the_seeded_requests_one_by_one(client: openai.OpenAI) -> None:
    def sampled(**extra):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0,
                                              extra_body={"ignore_eos": True}, **extra)

    several = sampled(n=3, seed=11)
    assert [c.index for c in several.choices] == [0, 1, 2]
    alone = [sampled(seed=11 + k).choices[0].message.content for k in range(3)]
    assert len(set(alone)) > 1, "the seeds give different samples"
    assert [c.message.content for c in several.choices] == alone
    single = chat(client, max_tokens=6)
    assert several.usage.prompt_tokens == single.usage.prompt_tokens, "the prompt counts once"
    assert several.usage.completion_tokens == 18


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(client: openai.OpenAI) -> None:
    prompts = ["w10 w11", "w20 w21 w22"]

    def sampled(**extra):
        return client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=1.0, seed=5,
                                          extra_body={"ignore_eos": True}, **extra)

    # The same five candidates a prompt, each with its tokens' logprobs (candidate k samples with seed + k).
    everything = sampled(n=5, logprobs=0)
    best = sampled(n=2, best_of=5)
    only_best = sampled(best_of=5)  # n defaults to 1: the single best of five
    for p in range(2):
        candidates = everything.choices[5 * p: 5 * p + 5]
        ranked = sorted(candidates, key=lambda c: -sum(c.logprobs.token_logprobs))
        assert [c.text for c in best.choices[2 * p: 2 * p + 2]] == [c.text for c in ranked[:2]]
        assert only_best.choices[p].text == ranked[0].text
    assert len(only_best.choices) == 2, "one choice a prompt"
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is None for c in best.choices), "logprobs only when asked for"
    assert best.usage.completion_tokens == 60, "every candidate's tokens count"
    echoed = sampled(n=1, best_of=3, echo=True)
    assert [c.text.startswith(p) for c, p in zip(echoed.choices, prompts)] == [True, True]


def test_batched_prompts_and_n_stream_every_choice_by_index(client: openai.OpenAI) -> None:
    prompts = ["w10 w11", "w20 w21 w22"]
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [complete(client, prompt=p, max_tokens=5).choices[0].text
                                               for p in prompts for _ in range(2)]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 20 == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    plain = complete(client, max_tokens=4).choices[0].text
    assert complete(client, max_tokens=4, echo=True).choices[0].text == PROMPT + plain
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain


def test_the_choices_of_a_prompt_share_its_cached_blocks(client: openai.OpenAI, server: InProcessServer) -> None:
    prompt = " ".join(f"w{100 + i}" for i in range(40))  # several full KV blocks
    before = server.engine.stats()
    client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3, temperature=0)
    after = server.engine.stats()
    # The three choices after the first find the prompt's full blocks in the prefix cache.
    full_blocks = (len(prompt.split()) - 1) // server.engine.engine.block_manager.block_size
    assert full_blocks >= 2
    assert after.prefix_hits - before.prefix_hits >= 3 * full_blocks
