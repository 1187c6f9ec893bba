"""Tool calling in the OpenAI shape: the tools a request offers, what its `tool_choice` asks of the output, and
the tool calls read back out of it.

- "none" (or no tools): the template is rendered without the tools, the output is text.
- "auto": the template is rendered with the tools; the model may answer in text or call tools in its own
  format, which the server's tool-call parser reads (tool_parsers.py: hermes for Qwen, llama3_json for Llama).
- "required": the output is constrained by the grammar to a JSON array of calls, each
  {"name": one of the tools, "parameters": arguments matching that tool's schema} (one call when
  parallel_tool_calls is false), so the calls always parse and match their schemas.
- a named function: the output is constrained to that function's arguments (its parameters' schema).
With "auto" and "required", a response with tool calls finishes with "tool_calls"; a named function finishes
with "stop", as OpenAI's does.

For a model whose chat template has no tool format of its own, the generic format (tool_prompts.py) stands in,
and the grammar enforces it for every tool_choice but "none": the output is `{"tool_calls": [...]}` (each call
{"name": one of the tools, "arguments": matching its schema}; one call unless parallel_tool_calls is true) or, with
"auto", `{"response": "..."}` (or the response_format's schema in place of the string). So "auto" works on any
model, and every call parses.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from shardserve.entrypoints.openai.fields import ClosedRequestModel, RequestModel, Text
from shardserve.entrypoints.openai.tool_parsers import ToolCall, make_tool_call_id
from shardserve.requests.sampling_params import StructuredOutput

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _function_name(value: str) -> str:
    if not _FUNCTION_NAME.match(value):
        raise ValueError(f"a function name is 1 to 64 letters, digits, underscores or dashes, got {value!r}")
    return value


FunctionName = Annotated[Text, AfterValidator(_function_name)]


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # the arguments always match the schema when the grammar enforces them

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(ClosedRequestModel):
    name: FunctionName


class NamedToolChoice(ClosedRequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallInMessage(RequestModel):
    name: Text
    arguments: Text  # JSON text of the arguments object, as the response carried it


class ToolCallInMessage(RequestModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallInMessage


# --------------------------------------------------------------------------- responses


class FunctionCallOut(RequestModel):
    name: str
    arguments: str


class ToolCallOut(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut

    @classmethod
    def of(cls, call: ToolCall) -> "ToolCallOut":
        return cls(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


def tool_call_delta(index: int, call_id: str | None = None, name: str | None = None,
                    arguments: str = "") -> dict[str, Any]:
    """A stream delta's entry for tool call `index`: its first carries the id and name, later ones add text
    to its arguments."""
    function: dict[str, Any] = {"arguments": arguments}
    entry: dict[str, Any] = {"index": index}
    if call_id is not None:
        entry.update(id=call_id, type="function")
        function = {"name": name, "arguments": arguments}
    entry["function"] = function
    return entry


# --------------------------------------------------------------------------- what a request asks for


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice mean for its prompt and output."""

    mode: Literal["none", "auto", "required", "named"]
    tools: list[dict[str, Any]]  # for the chat template (empty: rendered without tools)
    constraint: StructuredOutput | None = None  # what the grammar enforces ("required", "named"; generic: all)
    function: str | None = None  # "named": the function called
    parallel: bool = True
    generic: bool = False  # the generic format: the output is the JSON envelope, whatever the mode


def tool_plan(tools: list[ToolDefinition] | None, tool_choice: Any, parallel_tool_calls: bool | None,
              generic: bool = False, response_schema: dict[str, Any] | None = None) -> ToolPlan:
    """What the request's tools ask for; `generic`: in the generic format, whose "response" takes
    `response_schema` when given (a response_format's). Raises ValueError naming what is wrong (the caller
    answers 400 with param tool_choice)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {_describe(tool_choice)} needs tools, and the request sends none")
        return ToolPlan("none", [])
    if tool_choice == "none":
        return ToolPlan("none", [])
    by_name = {t.function.name: t.function for t in tools}
    if len(by_name) != len(tools):
        raise ValueError("tools must have distinct function names")
    template_tools = [t.model_dump(mode="json", exclude_none=True) for t in tools]
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in by_name:
        raise ValueError(f"tool_choice names function {tool_choice.function.name!r}, which is not among the tools "
                         f"({', '.join(map(repr, by_name))})")
    if generic:
        # One call unless the request asks for more: models that never learned the format repeat a call while
        # the array stays open (llama.cpp's server makes the same default).
        return _generic_plan(by_name, template_tools, tool_choice, parallel_tool_calls is True, response_schema)
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", template_tools, parallel=parallel)
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": f.arguments_schema},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, f in by_name.items()]}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", template_tools, StructuredOutput("json", json.dumps(schema)), parallel=parallel)
    name = tool_choice.function.name
    return ToolPlan("named", template_tools, StructuredOutput("json", json.dumps(by_name[name].arguments_schema)),
                    function=name, parallel=parallel)


def _generic_plan(by_name: dict[str, FunctionDefinition], template_tools: list[dict[str, Any]], tool_choice: Any,
                  parallel: bool, response_schema: dict[str, Any] | None) -> ToolPlan:
    """The generic format's envelope: {"tool_calls": [calls]} or, with "auto", {"response": ...}."""
    mode, function = "auto", None
    if tool_choice == "required":
        mode = "required"
    elif isinstance(tool_choice, NamedToolChoice):
        mode, function = "named", tool_choice.function.name
    callable_ = {function: by_name[function]} if function else by_name
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        _object(name={"const": name}, arguments=f.arguments_schema) for name, f in callable_.items()]}}
    if not parallel or function:
        calls["maxItems"] = 1
    envelope = _object(tool_calls=calls)
    if mode == "auto":
        envelope = {"anyOf": [envelope, _object(response=response_schema or {"type": "string"})]}
    return ToolPlan(mode, template_tools, StructuredOutput("json", json.dumps(envelope)), function=function,
                    parallel=parallel, generic=True)


def _object(**properties: Any) -> dict[str, Any]:
    """An object schema with exactly these properties, all required, in this order."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _describe(tool_choice: Any) -> str:
    if isinstance(tool_choice, NamedToolChoice):
        return f"naming function {tool_choice.function.name!r}"
    return repr(tool_choice)


def calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a "required" output (a JSON array of {"name", "parameters"}), or None if it is not one
    (cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [ToolCall(make_tool_call_id(), i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
            for i in items]


def template_tool_calls(calls: list[ToolCallInMessage]) -> list[dict[str, Any]]:
    """A message's tool calls as chat templates read them: arguments as an object (templates write them with
    `tojson`; a string would come out quoted twice), left as text only when they are not a JSON object."""
    rendered = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments
        if not isinstance(arguments, dict):
            arguments = call.function.arguments
        rendered.append({"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": arguments}})
    return rendered


ToolCallsField = Annotated[list[ToolCallInMessage] | None, Field(default=None)]
