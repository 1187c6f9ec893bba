"""Structured outputs as requests ask for them: OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_*` fields, turned into the one StructuredOutput the engine enforces (engine/grammar.py).

A request may set one constraint, in one of these ways; tools with `tool_choice` "required" or a named function
set one too (tools.py), and then no other may be set.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from shardserve.engine.grammar import GrammarError, check, choice_spec, tokenizer_problem
from shardserve.entrypoints.openai.errors import InvalidRequestError
from shardserve.entrypoints.openai.fields import ClosedRequestModel, RequestModel, Text
from shardserve.requests.sampling_params import StructuredOutput

# vLLM's older names for the members of structured_outputs.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class JsonSchemaFormat(RequestModel):
    name: Text = Field(default="response", max_length=64)
    description: Text | None = None
    # `schema` is a BaseModel attribute: the field is named otherwise and read from "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object: {\"name\": ..., \"schema\": {...}}")
        return self


class StructuredOutputsParams(ClosedRequestModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    # The layout is fixed here (engine/grammar.py): asking for no free whitespace asks for what is done anyway.
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None  # there is one engine, and nothing to fall back to

    def members(self) -> dict[str, Any]:
        return {name: value for name, value in (("json", self.json_), ("regex", self.regex),
                                                 ("choice", self.choice), ("grammar", self.grammar),
                                                 ("json_object", self.json_object or None))
                if value is not None}


def constraint_of(body: Any, tokenizer) -> tuple[StructuredOutput, str] | None:
    """The constraint a generation request sets, with the field that set it (for errors), or None.

    Raises InvalidRequestError naming the field when more than one is set or the one set does not compile."""
    found: list[tuple[StructuredOutput, str]] = []
    response_format: ResponseFormat | None = getattr(body, "response_format", None)
    if response_format is not None and response_format.type == "json_object":
        found.append((StructuredOutput("json_object"), "response_format"))
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema.json_schema
        found.append((StructuredOutput("json", json.dumps(schema)) if schema is not None
                      else StructuredOutput("json_object"), "response_format.json_schema"))
    if body.structured_outputs is not None:
        members = body.structured_outputs.members()
        if len(members) != 1:
            raise InvalidRequestError(
                f"structured_outputs takes exactly one of json, regex, choice, grammar and json_object; got "
                f"{', '.join(members) or 'none'}", param="structured_outputs")
        (kind, value), = members.items()
        found.append((_structured(kind, value), f"structured_outputs.{kind}"))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append((_structured(kind, value), field))
    if len(found) > 1:
        raise InvalidRequestError(f"only one structured output can be asked for, got {' and '.join(f for _, f in found)}",
                                  param=found[1][1])
    if not found:
        return None
    checked(*found[0], tokenizer)
    return found[0]


def checked(structured: StructuredOutput, param: str, tokenizer) -> StructuredOutput:
    """The constraint, once it compiles and the model's tokenizer can spell it; a 400 naming `param` and what is
    wrong otherwise."""
    try:
        check(structured)
    except (GrammarError, ValueError) as exc:
        raise InvalidRequestError(f"Invalid {param}: {exc}", param=param) from None
    problem = tokenizer_problem(tokenizer)
    if problem is not None:
        raise InvalidRequestError(f"Cannot honour {param}: {problem}", param=param)
    return structured


def checked_tool_schemas(tools) -> None:
    """Each tool's parameters are a JSON schema the grammar can enforce (whatever tool_choice is: a call the model
    writes must be checkable too); a 400 naming the tool's parameters otherwise."""
    for i, tool in enumerate(tools or ()):
        try:
            check(StructuredOutput("json", json.dumps(tool.function.arguments_schema)))
        except (GrammarError, ValueError) as exc:
            param = f"tools[{i}].function.parameters"
            raise InvalidRequestError(f"Invalid {param} of function {tool.function.name!r}: {exc}",
                                      param=param) from None


def _structured(kind: str, value: Any) -> StructuredOutput:
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json":
        return StructuredOutput("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return StructuredOutput("choice", choice_spec(value))
    return StructuredOutput(kind, value)
