"""The API key: what `--api-key` guards, checked in one place for every route.

As in vLLM, the key guards every path that starts with `/v1` (the OpenAI API: completions, chat,
models, and any unknown `/v1/...` path, which answers 401 rather than 404 without the key).
Everything else stays open: `/health`, `/version`, `/metrics`, `/tokenize`, `/detokenize`,
`/docs`, `/redoc` and `/openapi.json`. CORS preflights (`OPTIONS`) pass. The key is compared in
constant time and never logged.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from nanoserve.server.errors import APIError, error_response

GUARDED_PREFIX = "/v1"


def is_guarded(path: str) -> bool:
    """Whether a request to `path` needs the API key (vLLM's rule: the path starts with /v1)."""
    return path.startswith(GUARDED_PREFIX)


def has_valid_key(headers: Headers, api_key: str) -> bool:
    """`Authorization: Bearer <api_key>`, compared in constant time."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


class ApiKeyMiddleware:
    """Answers 401 to a request for a guarded path without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and is_guarded(scope["path"])
            and not has_valid_key(Headers(scope=scope), self.api_key)
        ):
            error = APIError(
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)
