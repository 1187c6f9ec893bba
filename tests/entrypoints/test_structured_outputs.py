"""Structured outputs over HTTP: whatever the model (here random weights), the output keeps to the schema, regex,
choice or grammar the request sets, in every way a client may ask for one; a constraint that cannot hold is a 400
naming its field."""

from __future__ import annotations

import functools
import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest

from tests.helpers.chat import post_chat, user

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tags"],
    "additionalProperties": False,
}


_chat = functools.partial(post_chat, defaults=dict(messages=user("Tell me about someone."), max_tokens=120))


def _error(response, status=400):
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_json_schema_holds_on_a_random_model_for_every_choice(byte_http, byte_server):
    response = _chat(byte_http, n=6, temperature=1.0, seed=3, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert byte_server.all_blocks_free()


def _no_key_twice(pairs):
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key twice: {keys}"
    return dict(pairs)


def test_an_object_that_lists_its_properties_admits_no_other_key(byte_http):
    # No "additionalProperties": as OpenAI's strict mode, the listed keys are the only keys, each once, at
    # every depth; "additionalProperties": true says otherwise, and is kept.
    open_ = {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": True}
    schema = {"type": "object", "required": ["name", "address", "extra"], "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}},
        "extra": open_}}
    response = _chat(byte_http, n=6, temperature=1.0, seed=5, max_tokens=300, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    assert response.status_code == 200, response.text
    finished = [c for c in response.json()["choices"] if c["finish_reason"] == "stop"]
    assert finished, "every choice ran to the length limit"
    for choice in finished:
        place = json.loads(choice["message"]["content"], object_pairs_hook=_no_key_twice)
        assert list(place) == ["name", "address", "extra"]
        assert set(place["address"]) <= {"city"}


def test_openai_parse_returns_the_pydantic_model(byte_server):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)
        colour: Literal["red", "blue"]

    client = byte_server.openai()
    completion = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Someone?"}],
                                               response_format=Person, max_tokens=100, temperature=0.8, seed=1)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.colour in ("red", "blue")


def test_a_streamed_constrained_output_joins_into_valid_json(byte_http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 120, "stream": True,
            "temperature": 0.9, "seed": 5, "structured_outputs": {"json": PERSON}}
    text, reasons = "", []
    with byte_http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content", "")
                reasons.append(choice["finish_reason"])
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
     lambda text: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text)),
    ("structured_outputs", {"choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    ("structured_outputs", {"grammar": 'start: "The answer is " ("yes" | "no") "."'},
     lambda text: text in ("The answer is yes.", "The answer is no.")),
    ("structured_outputs", {"grammar": 'root ::= "n=" [0-9] [0-9]'}, lambda text: re.fullmatch(r"n=[0-9]{2}", text)),
    ("guided_regex", r"(ab)+c", lambda text: re.fullmatch(r"(ab)+c", text)),
    ("guided_choice", ["left", "right"], lambda text: text in ("left", "right")),
    ("guided_json", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False}, lambda text: isinstance(json.loads(text)["ok"], bool)),
    ("response_format", {"type": "json_object"}, None),
])
def test_every_way_to_ask_for_a_constraint(byte_http, field, value, check):
    response = _chat(byte_http, n=4, temperature=1.0, seed=11, max_tokens=200, **{field: value})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        text = choice["message"]["content"]
        if check is None:  # any JSON object: unbounded, so a random model may run out of tokens inside one
            if choice["finish_reason"] == "stop":
                assert isinstance(json.loads(text), dict), text
            else:
                assert text.startswith("{")
            continue
        assert choice["finish_reason"] == "stop", choice
        assert check(text), text


def test_completions_take_constraints_too(byte_http):
    response = byte_http.post("/v1/completions", json={
        "model": "tiny", "prompt": ["a", "b"], "max_tokens": 20, "temperature": 1.0, "seed": 2,
        "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert response.status_code == 200, response.text
    assert {c["text"] for c in response.json()["choices"]} <= {"alpha", "beta"}


@pytest.mark.parametrize("body, param, words", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "regex"),
    ({"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar", ""),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", ""),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "whitespace"),
    ({"guided_regex": "a+", "min_tokens": 2}, None, "min_tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format.json_schema", "'uniqueItems', which structured outputs cannot enforce"),
])
def test_a_constraint_that_cannot_hold_is_a_400_naming_its_field(byte_http, byte_server, body, param, words):
    error = _error(_chat(byte_http, **body))
    assert error["param"] == param
    assert words in error["message"]
    assert _chat(byte_http, max_tokens=3).status_code == 200  # and the server serves on
    assert byte_server.all_blocks_free()
