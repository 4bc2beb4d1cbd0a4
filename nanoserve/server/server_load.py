"""Server load, as vLLM's `--enable-server-load-tracking` counts it for `/load`: the requests
to the generation routes that this server is answering now.

A request counts from its arrival until its answer's last byte has gone out (a stream's
`data: [DONE]`), or until its client leaves; a load balancer reads `/load` to pick the least
busy replica.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class ServerLoad:
    """How many generation requests are in flight (0 unless the middleware keeps it)."""

    def __init__(self) -> None:
        self.num_in_flight = 0


class ServerLoadMiddleware:
    """Counts each POST to a generation route in `load` while its answer is being sent."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        self.load.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.num_in_flight -= 1
