"""CORS as vLLM sets it up: Starlette's CORSMiddleware, configured by the `--allowed-origins`,
`--allowed-methods`, `--allowed-headers` and `--allow-credentials` flags (every origin, method
and header by default, no credentials). A preflight it refuses is a 400 in OpenAI's error
shape, naming what was refused, like every other error of this server."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from nanoserve.server.errors import error_body

_BODY_HEADERS = ("content-length", "content-type")


class CorsMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, its refused preflights answered as OpenAI-shaped 400s."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        verb = "are" if refused == "headers" else "is"
        message = (
            f"CORS preflight refused: its {refused} {verb} not allowed here (the server's "
            "--allowed-origins, --allowed-methods and --allowed-headers say what is)"
        )
        headers = {k: v for k, v in response.headers.items() if k.lower() not in _BODY_HEADERS}
        return JSONResponse(error_body(message, 400), status_code=400, headers=headers)
