"""What agent frameworks do with a server, through their own client code against the real server (random weights,
byte-level tokenizer, hermes tool format): langchain-openai's bind_tools and all three with_structured_output
methods, and litellm's tool calls and structured outputs."""

from __future__ import annotations

import json
from typing import Literal

import pydantic
import pytest


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]
    celsius: int = pydantic.Field(ge=-30, le=45)


def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """Current weather in a city."""
    return "sunny"


@pytest.fixture
def chat_model(byte_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{byte_server.url}/v1", api_key="unused", model="tiny", max_tokens=300,
                      temperature=1.0, seed=5, max_retries=0, timeout=120)


def test_langchain_bind_tools_gets_a_call_with_its_arguments(chat_model):
    message = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
    # "any" is langchain's name for "required"
    message = chat_model.bind_tools([get_weather], tool_choice="any").invoke("Weather in Rome?")
    assert message.tool_calls and all(c["name"] == "get_weather" for c in message.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_returns_the_model(chat_model, method):
    weather = chat_model.with_structured_output(Weather, method=method).invoke("Weather in Rome?")
    assert isinstance(weather, Weather)


def test_langchain_json_mode_returns_a_json_object(chat_model):
    # json_mode asks for any JSON object (response_format json_object), which has no bound: with these random
    # weights, this seed closes its object well within max_tokens.
    result = chat_model.with_structured_output(method="json_mode").invoke("Reply in JSON.")
    assert isinstance(result, dict)


@pytest.fixture
def litellm(monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list
    import litellm

    return litellm


def test_litellm_tool_calls_and_structured_outputs(litellm, byte_server):
    target = dict(model="openai/tiny", api_base=f"{byte_server.url}/v1", api_key="unused", max_tokens=300, seed=5,
                  temperature=1.0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}}
    response = litellm.completion(messages=[{"role": "user", "content": "Weather?"}], tools=[tool],
                                  tool_choice="required", **target)
    assert response.choices[0].finish_reason == "tool_calls"
    call = response.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)
    response = litellm.completion(messages=[{"role": "user", "content": "Weather?"}], response_format=Weather,
                                  **target)
    Weather.model_validate(json.loads(response.choices[0].message.content))
