"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Anything a client can send is answered with a 4xx that says what was wrong; a 500 means a bug
in the server and is logged with its traceback. The engine client's errors reach HTTP through
one function, `engine_error`, whether they end a JSON answer, a stream's last frame or the start
of a run.
"""

from __future__ import annotations

import logging
import reprlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.client.engine_client import EngineDeadError, RequestRejectedError

logger = logging.getLogger("nanoserve.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}

RETRY_AFTER_S = "1"  # a worker that is starting, restarting or busy: retry soon
# What the engine client raises into a request's stream (or while adding its requests).
ENGINE_ERRORS = (EngineDeadError, RequestRejectedError)

# Names pydantic puts in an error's location for the member of a union that failed.
_UNION_MEMBER_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """An error to answer with `status_code` and an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, self.param)


class ClientDisconnected(Exception):
    """The client closed its connection before the response was ready."""


def service_unavailable(message: str) -> APIError:
    """A 503 the client may retry after RETRY_AFTER_S seconds."""
    return APIError(message, 503, headers={"Retry-After": RETRY_AFTER_S})


def engine_error(
    error: EngineDeadError | RequestRejectedError, param: str | None = None
) -> APIError:
    """The HTTP error for an engine client's error.

    EngineDeadError (no worker can serve the request: dead, restarting, shutting down) is a 503
    to retry; RequestRejectedError (the engine refused the request, e.g. a grammar that does not
    compile) is a 400, naming `param` when the caller knows which field gave what was refused.
    """
    if isinstance(error, EngineDeadError):
        return service_unavailable(str(error))
    return APIError(str(error), 400, param)


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status_code, "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 naming the first invalid field (pydantic's errors, with union members folded)."""
    if not errors:
        return APIError("the request body is invalid")
    first = errors[0]
    path = []
    for part in first.get("loc", ()):
        if part == "body":
            continue
        if isinstance(part, str) and (part in _UNION_MEMBER_NAMES or "[" in part):
            break  # "prompt.list[int]" -> "prompt": the field, not the union member tried
        path.append(str(part))
    param = ".".join(path) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = f"{param} is required"
    elif first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])  # our validators' messages name the field
    elif param is not None:
        message = f"{param}: {message}"
        if "input" in first and first.get("type") != "extra_forbidden":
            message += f" (got {_short_repr(first['input'])})"
    return APIError(message, 400, param)


def _short_repr(value: Any) -> str:
    """A short repr: a few levels and items deep (a client's value may be nested 900 deep)."""
    return reprlib.repr(value)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error, including FastAPI's own, answer in OpenAI's shape (400, never 422)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error([dict(error) for error in exc.errors()]))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error([dict(error) for error in exc.errors()]))

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        error = APIError(message, exc.status_code, headers=getattr(exc, "headers", None))
        return error_response(error)

    @app.exception_handler(Exception)
    async def _server_bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(f"internal server error: {type(exc).__name__}", 500))
