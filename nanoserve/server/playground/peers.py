"""The playground's peers: other OpenAI-compatible servers (`--playground-peer NAME=URL`) that
the page races against, reached through this server so that the browser needs no CORS from
them. Under /v1, so this server's API key guards them too.

Only what the page needs passes (`PEER_PATHS`); the answer, a stream too, is relayed as it
arrives, and a client that leaves closes the connection to the peer (which aborts there).
A peer that does not answer is a 502 in OpenAI's error shape.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from nanoserve.server.config import ServerConfig
from nanoserve.server.errors import APIError
from nanoserve.server.request_body import check_media_type, read_body
from nanoserve.server.request_timeline import TIMELINE_HEADER

# (method, path at the peer) the page uses.
PEER_PATHS = (
    ("GET", re.compile(r"health")),
    ("GET", re.compile(r"metrics")),
    ("GET", re.compile(r"v1/models")),
    ("POST", re.compile(r"v1/chat/completions")),
    ("POST", re.compile(r"v1/completions")),
    ("GET", re.compile(r"v1/requests/[A-Za-z0-9_.-]{1,200}/timeline")),
)
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # a peer that holds a stream silent this long is given up on
RELAYED_HEADERS = ("content-type", "retry-after")


def router(config: ServerConfig) -> APIRouter:
    """/v1/playground/peers (their names) and /v1/playground/peers/{name}/{path}."""
    api = APIRouter()
    peers = dict(config.playground_peers)

    @api.get("/v1/playground/peers")
    async def peer_names() -> dict[str, list[str]]:
        return {"peers": list(peers)}

    async def relay(name: str, path: str, request: Request) -> Response:
        if name not in peers:
            raise APIError(f"no playground peer is named {name!r}", 404)
        if not any(request.method == m and p.fullmatch(path) for m, p in PEER_PATHS):
            allowed = ", ".join(f"{m} {p.pattern}" for m, p in PEER_PATHS)
            raise APIError(f"a playground peer serves only {allowed}; got {path!r}", 404)
        body = b""
        if request.method == "POST":
            check_media_type(request.headers.get("content-type"))
            body = await read_body(request, config.max_body_bytes)
        return await _relay(name, f"{peers[name]}/{path}", request, body)

    for method in ("GET", "POST"):
        api.add_api_route(
            "/v1/playground/peers/{name}/{path:path}",
            relay,
            methods=[method],
            operation_id=f"playground_peer_{method.lower()}",
        )
    return api


async def _relay(name: str, url: str, request: Request, body: bytes) -> Response:
    """Send the request on, then stream the peer's answer back with its status."""
    headers = {"content-type": "application/json"}
    if TIMELINE_HEADER in request.headers:
        headers[TIMELINE_HEADER] = request.headers[TIMELINE_HEADER]
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    client = httpx.AsyncClient(timeout=timeout)
    try:
        upstream = await client.send(
            client.build_request(request.method, url, content=body or None, headers=headers),
            stream=True,
        )
    except httpx.HTTPError as e:
        await client.aclose()
        raise APIError(f"the playground peer {name!r} did not answer: {e!r}", 502) from None

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError:
            pass  # the peer broke off: the answer ends here, as the peer's did
        finally:
            await upstream.aclose()
            await client.aclose()

    relayed = {k: v for k, v in upstream.headers.items() if k.lower() in RELAYED_HEADERS}
    return StreamingResponse(chunks(), status_code=upstream.status_code, headers=relayed)
