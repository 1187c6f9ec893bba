"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` bodies for every failure.

Handlers raise an `APIError` subclass; `install_error_handlers` turns those, FastAPI's own
validation and routing errors, and anything unexpected into that shape, so a client never
sees a framework-specific body.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# Longest rendering of an offending input value quoted back in a validation message.
_MAX_QUOTED_INPUT = 60


class APIError(Exception):
    """An error the client should see, with the HTTP status and OpenAI `type` of its class."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)

    def to_response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=headers)


class InvalidRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "invalid_request_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class RequestTooLargeError(APIError):
    status_code = 413
    error_type = "invalid_request_error"


class ServerError(APIError):
    status_code = 500
    error_type = "server_error"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "server_error"


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def model_not_found(requested: str, served: str) -> NotFoundError:
    return NotFoundError(
        f"The model '{requested}' does not exist. This server serves '{served}'.",
        param="model",
        code="model_not_found",
    )


def validation_error_to_api_error(errors: Sequence[dict[str, Any]]) -> InvalidRequestError:
    """Describe the first of pydantic's/FastAPI's errors as a 400 naming the field and the problem."""
    if not errors:
        return InvalidRequestError("Invalid request body.")
    error = errors[0]
    loc = tuple(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]

    if error.get("type") == "json_invalid":
        # FastAPI puts the character position of the syntax error where a field name would be.
        reason = error.get("ctx", {}).get("error", "malformed JSON")
        position = f" at character {loc[0]}" if loc else ""
        return InvalidRequestError(f"The request body is not valid JSON: {reason}{position}.")

    refused = error.get("ctx", {}).get("error")
    if getattr(refused, "param", None) and getattr(refused, "why", None):  # protocol.REFUSED_FIELDS
        return InvalidRequestError(f"Unsupported parameter '{refused.param}': {refused.why}.", param=refused.param,
                                   code="unsupported_parameter")
    param = format_loc(loc)
    if param is None:
        return InvalidRequestError(_body_problem(error))
    if error.get("type") == "missing":
        return InvalidRequestError(f"Missing required parameter: '{param}'.", param=param)
    return InvalidRequestError(f"Invalid value for '{param}': {_problem(error)}", param=param)


def format_loc(loc: Sequence[str | int]) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"; an empty location (the whole body) -> None."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else str(part)
    return param or None


def _body_problem(error: dict[str, Any]) -> str:
    """An error about the body as a whole rather than one field."""
    if error.get("type") == "missing":
        return "The request body is empty; send a JSON object."
    if isinstance(error.get("input"), bytes):
        # FastAPI hands the raw bytes on when the content type is not JSON.
        return "The request body must be JSON, sent with 'Content-Type: application/json'."
    return f"The request body must be a JSON object: {_problem(error)}"


def _problem(error: dict[str, Any]) -> str:
    if error.get("type") == "value_error" and "error" in error.get("ctx", {}):
        # Our own validators' messages, without pydantic's "Value error, " prefix.
        return str(error["ctx"]["error"])
    problem = str(error.get("msg", "invalid value"))
    if "input" in error:
        quoted = repr(error["input"])
        if len(quoted) > _MAX_QUOTED_INPUT:
            quoted = quoted[: _MAX_QUOTED_INPUT - 3] + "..."
        problem += f" (got {quoted})"
    return problem


async def _api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.to_response()


async def _validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error_to_api_error(exc.errors()).to_response()


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Routing errors (unknown path, wrong method) and Starlette's own HTTP errors."""
    assert isinstance(exc, StarletteHTTPException)
    unparsable = _unparsable_body(exc.__cause__)
    if unparsable is not None:
        return unparsable.to_response()
    error_type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    body = error_body(f"{exc.detail}: {request.method} {request.url.path}", error_type)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _unparsable_body(cause: BaseException | None) -> InvalidRequestError | None:
    """FastAPI answers a body `json.loads` fails on other than with a syntax error as a bare 400 "There was
    an error parsing the body", with the reason as the cause; say what the reason was."""
    if isinstance(cause, UnicodeDecodeError):
        return InvalidRequestError(f"The request body is not valid UTF-8: byte {cause.object[cause.start]:#04x} at "
                                   f"position {cause.start} ({cause.reason}). Send JSON encoded as UTF-8.")
    if isinstance(cause, RecursionError):
        return InvalidRequestError("The request body is nested too deeply to parse.")
    return None


async def _unexpected_error_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request", exc_info=exc)
    return ServerError("Internal server error.").to_response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
