"""ASGI middlewares of the OpenAI-compatible server: the API-key check and the request-body size limit.

Both sit in front of the FastAPI app and answer refusals themselves, in the OpenAI error shape
of errors.py, before any route sees the request. `require_api_key` puts the key check in front of
an app; `shardserve serve` and the pool's router (pool/router.py) both use it.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shardserve import envs
from shardserve.entrypoints.openai.errors import AuthenticationError, RequestTooLargeError

# `serve --api-key` and `pool --api-key` default to this variable, which keeps the key off the command line
# (that `ps` shows every user); ranks never publish it in their start-up fingerprints.
API_KEY_ENV = envs.API_KEY.name

# Paths a load balancer may probe without the API key. Everything else needs it, /metrics included
# (Prometheus sends the key with `authorization: {credentials: KEY}`), and so do /docs and /openapi.json.
PUBLIC_PATHS = frozenset({"/health", "/version"})


def api_key_in_force(flag: str | None, fallback: str | None = None) -> str | None:
    """The API key to require: the --api-key flag's, else $SHARDSERVE_API_KEY (an empty value counts as
    unset), else `fallback` (the pool config's api_key)."""
    if flag is not None:
        return flag
    return envs.API_KEY.get() or fallback


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    """With `api_key`, every path of `app` but PUBLIC_PATHS requires `Authorization: Bearer <api_key>`;
    without, `app` is left open. Call it after adding the other middlewares: Starlette runs the one added
    last first, so the key is checked before anything else reads the request."""
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, public_paths=PUBLIC_PATHS)


class BearerAuth:
    """Requires `Authorization: Bearer <api_key>` on every path but `public_paths`."""

    def __init__(self, app: ASGIApp, api_key: str, public_paths: Collection[str]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public_paths:
            await self.app(scope, receive, send)
            return
        error = self._check(Headers(scope=scope).get("authorization"))
        if error is None:
            await self.app(scope, receive, send)
            return
        response = error.to_response(headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _check(self, authorization: str | None) -> AuthenticationError | None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return AuthenticationError("Missing API key: send it in an 'Authorization: Bearer <key>' header.")
        if not hmac.compare_digest(token.encode(), self._key):
            return AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        return None


class BodySizeLimit:
    """Reads each request body in full and answers 413 once it exceeds `max_body_bytes`.

    The app then receives the body as a single message; later `receive()` calls go to the
    server, so handlers still hear about the client disconnecting.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _discard_body(receive)
            await self._too_large()(scope, receive, send)
            return

        chunks: list[bytes] = []
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await _discard_body(receive)
                await self._too_large()(scope, receive, send)
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)

        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self) -> Response:
        limit = self.max_body_bytes
        error = RequestTooLargeError(f"The request body is larger than this server's limit of {limit} bytes "
                                     f"({limit / 2**20:g} MiB; the server's --max-request-body-mb sets it).")
        # Past the discard cap the rest of the body is left unread, so the connection is not reused.
        return error.to_response(headers={"Connection": "close"})


# An oversized body is read and thrown away up to this many bytes before the 413 goes out, so a client
# that writes its whole body before reading the answer gets the 413 instead of a reset connection.
DISCARD_CAP_BYTES = 64 * 2**20


async def _discard_body(receive: Receive) -> None:
    discarded = 0
    while discarded <= DISCARD_CAP_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        discarded += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
