"""Which endpoints answer without the API key: every documented route, FastAPI's own pages and an unknown
path, asked without a key, with a wrong key and with a key that differs only in case."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from tests.reliability.fuzz import openai_error_problem

PUBLIC = frozenset({("GET", "/health"), ("GET", "/version")})
EXTRA_ENDPOINTS = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/no/such/path"),
                   ("POST", "/v1/embeddings")]


@dataclass
class AuthFigures:
    endpoints: list[tuple[str, str]] = field(default_factory=list)
    asked: int = 0  # requests sent without the right key
    refused: int = 0  # of those to non-public endpoints, answered 401 with an OpenAI error
    public_open: int = 0  # of those to /health and /version, answered 200
    let_in: list[str] = field(default_factory=list)  # "KEY METHOD PATH -> STATUS" that should have been refused


def probe_auth(url: str, api_key: str) -> AuthFigures:
    figures = AuthFigures()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as http:
        paths = http.get("/openapi.json").json()["paths"]
    figures.endpoints = [(method.upper(), path) for path, item in paths.items() for method in item] + EXTRA_ENDPOINTS
    for key in (None, "sk-wrong", api_key.upper()):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            for method, path in figures.endpoints:
                response = http.request(method, path, json={"prompt": "w10", "max_tokens": 1})
                figures.asked += 1
                if (method, path) in PUBLIC:
                    figures.public_open += response.status_code == 200
                elif (response.status_code == 401 and openai_error_problem(response) is None
                      and "API key" in response.json()["error"]["message"]
                      and response.headers.get("www-authenticate") == "Bearer"):
                    figures.refused += 1
                else:
                    figures.let_in.append(f"{key} {method} {path} -> {response.status_code}")
    return figures
