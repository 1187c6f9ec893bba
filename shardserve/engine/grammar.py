"""Structured outputs as grammars of the llguidance engine: compiling a request's constraint, and checking it.

Why llguidance (benchmarks/grammar_backends.py has the numbers): it builds no per-schema automaton ahead of
time (an agent sends a new schema with nearly every request, and the first mask comes in well under a
millisecond), it computes the masks of a whole batch on its own threads without the GIL, it takes JSON schema,
regular expressions and Lark or GBNF grammars through one interface, and it is one self-contained wheel (no
torch, triton or transformers pins that would tie the server's versions to it).

JSON comes out in one fixed layout: `{"a": 1, "b": [1, 2]}` (", " between items, ": " after keys, no other
whitespace). Flexible whitespace lets a model pad with spaces and newlines forever, which weak or random
models do; one layout also makes outputs comparable. This module imports no torch: front ends use it to
refuse a bad constraint with a 400 before it reaches the engine.

JSON schemas are enforced as OpenAI's strict mode and xgrammar's default enforce them (`closed_objects`): an
object schema that lists its properties admits no other key unless it says `additionalProperties` itself, so
a model cannot run on inventing keys, or write one twice, until its length limit. A keyword the grammar engine
cannot enforce (`uniqueItems`, `if`/`then`, `not`, `contains`...) is refused by name, never ignored.
"""

from __future__ import annotations

import functools
import json
import re

import llguidance

from shardserve.requests.sampling_params import StructuredOutput

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


# Where a JSON schema holds subschemas: keywords whose value is one, a list of them, or a map to them.
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """`schema` with `"additionalProperties": false` added to every object schema that lists `properties` and
    says nothing of other keys, at any depth ($defs included). A schema that says `additionalProperties`
    keeps what it says. An `allOf` and its direct members are left open at their own level: each would close
    out the properties the others add."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    says_other_keys = "additionalProperties" in closed or "unevaluatedProperties" in closed
    if "properties" in closed and not says_other_keys and not _adds_properties(closed.get("allOf")):
        closed["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(s) for s in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(s) for name, s in closed[key].items()}
    if isinstance(closed.get("allOf"), list):
        closed["allOf"] = [_open_member(s) for s in closed["allOf"]]
    return closed


def _adds_properties(members) -> bool:
    return isinstance(members, list) and any(isinstance(m, dict) and "properties" in m for m in members)


def _open_member(schema):
    """An allOf member: closed inside, but left open at its own level."""
    if not isinstance(schema, dict) or "properties" not in schema or "additionalProperties" in schema:
        return closed_objects(schema)
    return {key: value for key, value in closed_objects(schema).items() if key != "additionalProperties"}


class GrammarError(ValueError):
    """A constraint that does not compile; the message says what is wrong with it, in the engine's words."""


@functools.lru_cache(maxsize=1024)
def grammar_of(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (cached: the same schema comes again with every request of an
    agent). Raises GrammarError when the constraint is malformed."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, overrides=JSON_LAYOUT)
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("a choice needs a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    try:
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def check(structured: StructuredOutput) -> str:
    """The compiled grammar of a constraint, once it is known to be valid; GrammarError otherwise."""
    grammar = grammar_of(structured)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(_plain(error.strip()))
    return grammar


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def _plain(error: str) -> str:
    """The grammar engine's error, with the JSON schema keywords it cannot enforce named as such."""
    unimplemented = _UNIMPLEMENTED.search(error)
    if unimplemented is None:
        return error
    keys = unimplemented.group(1).replace('"', "'")
    return (f"the JSON schema uses {keys}, which structured outputs cannot enforce; drop the keyword or check it "
            f"in the client ({error})")


_tokenizer_problems: dict[int, str | None] = {}


def tokenizer_problem(tokenizer) -> str | None:
    """Why the grammar engine cannot spell outputs with this model's tokenizer (a shardserve Tokenizer), or None
    when it can. Built once per tokenizer (a fraction of a second to a few seconds), so a front end can refuse a
    constraint with a 400 naming its field instead of letting the engine refuse the request."""
    key = id(tokenizer)
    if key not in _tokenizer_problems:
        import llguidance.hf

        try:
            llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer)
            _tokenizer_problems[key] = None
        except (ValueError, RuntimeError) as exc:
            _tokenizer_problems[key] = (f"structured outputs need a tokenizer whose tokens are bytes or text "
                                        f"pieces, and the grammar engine cannot read this model's ({exc})")
    return _tokenizer_problems[key]


def choice_spec(choices: list[str]) -> str:
    return json.dumps(choices, ensure_ascii=False)
