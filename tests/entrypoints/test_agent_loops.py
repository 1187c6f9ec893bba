"""Agent loops as people run them, through each client's own code, against the real SmolLM2: its chat template
has no tool format, so tools, calls and results reach the model in shardserve's generic format, and the
default tool_choice ("auto") works. Each loop calls the tool, sends the result back and gets a 200; the
result is in the prompt the model saw (`/tokenize` renders the same messages as the chat request did).
Structured outputs from instructor and the `llm` CLI, whose schemas do not close their objects, hold only
the keys the schema lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Iterator

import httpx
import openai
import pydantic
import pytest

from tests.serving import InProcessServer, serve_model

MODEL = "smollm2"
QUESTION = "Weather in Paris?"
RESULT = "18 degrees and sunny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def smol(smollm2_gguf) -> Iterator[InProcessServer]:
    with serve_model(smollm2_gguf, name=MODEL, max_model_len=2048, kv_cache_memory_gb=0.1) as running:
        yield running


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return RESULT


def _prompt_seen(server: InProcessServer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, int]:
    """The prompt a chat request with these messages and tools renders to, as text, and its length."""
    with server.http() as http:
        ids = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": tools}).json()["tokens"]
        return http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"], len(ids)


def test_openai_sdk_tool_loop(smol):
    client = smol.openai()
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=60)
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    # The SDK's own message goes back as it is: content null, with tool_calls.
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    assert messages[1].get("content") is None
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                            max_tokens=60)
    assert second.choices[0].finish_reason in ("stop", "tool_calls", "length")
    prompt, length = _prompt_seen(smol, messages, [WEATHER])
    assert RESULT in prompt and call.function.arguments in prompt and "get_weather" in prompt
    assert second.usage.prompt_tokens == length


def test_langchain_bind_tools_with_the_default_tool_choice(smol):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{smol.url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60,
                      max_retries=0, timeout=300).bind_tools([get_weather])
    history = [HumanMessage(QUESTION)]
    called = chat.invoke(history)
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"]
    history += [called, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    answer = chat.invoke(history)
    assert answer.response_metadata["finish_reason"] in ("stop", "tool_calls", "length")
    sent = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call["id"], "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(call["args"])}}]},
            {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    prompt, length = _prompt_seen(smol, sent, [WEATHER])
    assert RESULT in prompt
    assert answer.usage_metadata["input_tokens"] == length


def test_litellm_tool_loop(smol, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list
    import litellm

    target = dict(model=f"openai/{MODEL}", api_base=f"{smol.url}/v1", api_key="unused", temperature=0,
                  max_tokens=60, tools=[WEATHER])
    messages = [{"role": "user", "content": QUESTION}]
    first = litellm.completion(messages=messages, **target)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = litellm.completion(messages=messages, **target)
    assert second.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert RESULT in _prompt_seen(smol, messages, [WEATHER])[0]


def test_pydantic_ai_agent_with_one_tool_answers_in_text(smol):
    from pydantic_ai import Agent, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    sent = []  # each chat request's body, as the agent sent it

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    client = openai.AsyncOpenAI(base_url=f"{smol.url}/v1", api_key="unused",
                                http_client=httpx.AsyncClient(event_hooks={"request": [record]}, timeout=300))
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
    calls = []

    def weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return RESULT

    def once(ctx, definition):  # offered until called: then the agent must answer with what it got
        return None if calls else definition

    agent = Agent(model, tools=[Tool(weather, prepare=once)], model_settings={"temperature": 0, "max_tokens": 60})
    result = agent.run_sync(QUESTION, usage_limits=UsageLimits(request_limit=4))
    assert calls, "the agent never called its tool"
    assert isinstance(result.output, str) and result.output.strip()
    tool_returns = [part for message in result.all_messages() for part in message.parts
                    if part.part_kind == "tool-return"]
    assert tool_returns and tool_returns[0].content == RESULT
    last = sent[-1]
    assert RESULT in _prompt_seen(smol, last["messages"], last.get("tools"))[0]


class City(pydantic.BaseModel):
    name: str
    country: str
    is_capital: bool


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_fills_the_model_with_only_its_keys(smol, mode):
    import instructor

    client = instructor.from_openai(smol.openai(), mode=getattr(instructor.Mode, mode))
    city, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=City, max_retries=0, temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Describe Paris."}])
    assert isinstance(city, City)
    message = completion.choices[0].message
    raw = message.tool_calls[0].function.arguments if mode == "TOOLS" else message.content
    assert set(json.loads(raw)) == set(City.model_fields)


def test_llm_cli_schema_gives_an_object_with_only_the_listed_keys(smol, tmp_path):
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: {MODEL}\n  model_name: {MODEL}\n  api_base: {smol.url}/v1\n  supports_schema: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused"}
    done = subprocess.run([sys.executable, "-m", "llm", "-m", MODEL, "--no-log", "-o", "temperature", "0",
                           "-o", "max_tokens", "120", "--schema", "name, country, is_capital bool", "Describe Paris."],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert set(answer) == {"name", "country", "is_capital"} and isinstance(answer["is_capital"], bool)
