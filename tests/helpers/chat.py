"""Chat requests over HTTP to a served tiny model ("tiny"), and the two tools the tool-calling tests offer."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema

MODEL = "tiny"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def user(content: str) -> list[dict[str, Any]]:
    """The messages of a conversation of one user turn."""
    return [{"role": "user", "content": content}]


def post_chat(http: httpx.Client, defaults: dict[str, Any], **body) -> httpx.Response:
    """POST /v1/chat/completions for MODEL: `defaults` (a module's usual request), then `body` over them."""
    return http.post("/v1/chat/completions", json={"model": MODEL, **defaults, **body})


def chat_ok(http: httpx.Client, defaults: dict[str, Any], **body) -> dict[str, Any]:
    """post_chat's response body, asserting a 200."""
    response = post_chat(http, defaults, **body)
    assert response.status_code == 200, response.text
    return response.json()


def check_calls(calls: list[dict[str, Any]]) -> None:
    """Each tool call is well-formed and its arguments keep to its tool's schema."""
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def stream_chat(http: httpx.Client, **body) -> tuple[str, str, list[dict[str, Any]], str]:
    """A streamed chat (by default "Weather?" with both tools) reassembled as a client does: (content,
    reasoning_content, tool calls joined by index, the last finish_reason)."""
    body = {"model": MODEL, "messages": user("Weather?"), "max_tokens": 150, "tools": [WEATHER, TIME],
            "stream": True, **body}
    content, reasoning, calls, reasons = "", "", {}, []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for entry in delta.get("tool_calls") or []:
                call = calls.setdefault(entry["index"], {"id": None, "type": "function",
                                                         "function": {"name": None, "arguments": ""}})
                call["id"] = entry.get("id") or call["id"]
                call["function"]["name"] = entry["function"].get("name") or call["function"]["name"]
                call["function"]["arguments"] += entry["function"].get("arguments") or ""
            reasons.append(choice["finish_reason"])
    return content, reasoning, [calls[i] for i in sorted(calls)], reasons[-1]
