"""Fuzzing with schemathesis against the server's own /openapi.json: requests the schema allows (positive)
and requests it forbids (negative), for every operation.

What every response must be: never a 5xx; an error is a 4xx whose body has exactly the OpenAI shape
{"error": {"message", "type", "param", "code"}}, and when it names a field in `param`, its message
names that field too; a request the schema forbids is refused; and what the server sends matches
what its schema documents (status codes, content types, bodies).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import hypothesis
import hypothesis.errors
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.errors import SerializationNotPossible
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

# /sleep would put the model to sleep and hold every later request until a wake: an operator's switch,
# not an input to fuzz (its bad levels are in the hand-written list).
NOT_FUZZED = frozenset({"/sleep"})
SCHEMA_CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance,
                 negative_data_rejection]


@dataclass
class FuzzFigures:
    cases: int = 0  # requests sent
    by_status: Counter = field(default_factory=Counter)
    violations: Counter = field(default_factory=Counter)  # what went wrong -> how many cases
    operations: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)  # the first few violations, to read

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.by_status.items() if status >= 500)

    def violate(self, what: str, case, response: requests.Response) -> None:
        self.violations[what] += 1
        if len(self.examples) < 5:
            body = case.body if not isinstance(case.body, bytes) else case.body[:200]
            self.examples.append(f"{what}: {case.method} {case.path} query={case.query} body={body!r:.300} -> "
                                 f"{response.status_code} {response.text[:300]}")


def openai_error_problem(response: requests.Response) -> str | None:
    """Why an error response is not an OpenAI error naming its field, or None if it is one."""
    try:
        body = response.json()
    except ValueError:
        return "error body is not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(error, dict):
        return "error body is not {\"error\": {...}}"
    if set(error) != {"message", "type", "param", "code"}:
        return "error object lacks message/type/param/code"
    if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)):
        return "error message or type is not a string"
    param = error["param"]
    if param is not None and param.split("[")[0].split(".")[0] not in error["message"]:
        return "error message does not name its param"
    return None


def fuzz(url: str, max_examples: int, seed: int, api_key: str | None = None) -> FuzzFigures:
    """Up to `max_examples` positive and as many negative cases per operation, reproducibly from `seed`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers, timeout=30)
    figures = FuzzFigures()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in NOT_FUZZED:
            continue
        figures.operations.append(f"{operation.method.upper()} {operation.path}")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(operation, mode, url, headers, session, max_examples, seed, figures)
    return figures


def _fuzz_operation(operation, mode, url, headers, session, max_examples, seed, figures) -> None:
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hypothesis.seed(seed)
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        try:
            response = case.call(base_url=url, session=session, headers=headers, timeout=120)
        except SerializationNotPossible:
            return  # a negative case no client could send (e.g. a body no media type can carry)
        except requests.RequestException as exc:  # the server dropped the connection or hung
            figures.cases += 1
            figures.violations[f"no response ({type(exc).__name__})"] += 1
            return
        figures.cases += 1
        figures.by_status[response.status_code] += 1
        if response.status_code >= 500:
            figures.violate("5xx", case, response)
        elif response.status_code >= 400:
            problem = openai_error_problem(response)
            if problem:
                figures.violate(problem, case, response)
        try:
            case.validate_response(response, checks=SCHEMA_CHECKS)
        except (AssertionError, FailureGroup) as failure:
            for name in _failed_checks(failure):
                figures.violate(name, case, response)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        pass  # nothing to make invalid: an operation without parameters or body has no negative cases


def _failed_checks(failure: AssertionError) -> list[str]:
    """The schemathesis checks a failure reports, by title."""
    nested = getattr(failure, "exceptions", None) or [failure]
    return sorted({getattr(f, "title", type(f).__name__) for f in nested})


def describe(figures: FuzzFigures) -> str:
    return json.dumps({"cases": figures.cases, "by_status": dict(figures.by_status),
                       "violations": dict(figures.violations), "examples": figures.examples}, indent=1)
