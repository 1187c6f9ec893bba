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
"""

from __future__ import annotations

import functools
import json

import llguidance

from shardserve.engine.sampling_params import StructuredOutput

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


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
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
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
        raise GrammarError(error.strip())
    return grammar


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
