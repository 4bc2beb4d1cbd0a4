"""HTTP plumbing shared by the routes: watching for disconnects and responding.

(Bodies are read in `request_body.py`.) A client that goes away — streaming or not — has its
engine requests aborted at once and is counted in `vllm:http_requests_client_disconnected_total`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from nanoserve.client.engine_client import EngineDeadError, RequestRejectedError
from nanoserve.server.errors import APIError
from nanoserve.server.openai.request_run import NamedEvent, RequestRun, sse_stream
from nanoserve.server.openai.serving import service_unavailable
from nanoserve.server.request_body import ClientDisconnected
from nanoserve.server.state import server_state

R = TypeVar("R")


class EventStreamResponse(StreamingResponse):
    """An SSE response that always calls `on_close(is_complete)`, however the stream ends.

    Starlette cancels the body iterator when the client disconnects; the callback then runs
    even if the iterator never started. A connection lost while the last frames were already
    at hand (uvicorn's sends to a lost connection return at once) is noticed too: the stream
    lets the disconnect watcher run once more before it calls itself complete.
    """

    def __init__(self, frames: AsyncIterator[str], on_close: Callable[[bool], None]) -> None:
        self._is_complete = False

        async def track() -> AsyncIterator[str]:
            async for frame in frames:
                yield frame
            await asyncio.sleep(0)  # a pending disconnect cancels the stream here
            self._is_complete = True

        super().__init__(
            track(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close(self._is_complete)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_unless_disconnected(request: Request, work: Awaitable[R]) -> R:
    """Await `work`, but raise ClientDisconnected as soon as the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientDisconnected


def json_response(body: BaseModel | dict[str, Any]) -> Response:
    text = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return Response(text, media_type="application/json")


async def respond(
    request: Request,
    run: RequestRun,
    stream: bool,
    chunks: Callable[[], AsyncIterator[BaseModel | NamedEvent]],
    whole: Callable[[], Awaitable[BaseModel | dict[str, Any]]],
) -> Response:
    """Stream `chunks()` as SSE, or answer `whole()` as JSON; either way, end the run."""
    metrics = server_state(request).metrics

    def finish(is_complete: bool) -> None:
        run.close()
        if not is_complete:
            metrics.http_requests_client_disconnected.inc()

    if stream:
        return EventStreamResponse(sse_stream(chunks()), on_close=finish)
    is_complete = True
    try:
        return json_response(await wait_unless_disconnected(request, whole()))
    except ClientDisconnected:
        is_complete = False
        return Response(status_code=499)  # nobody is listening any more
    except EngineDeadError as e:
        raise service_unavailable(str(e)) from None
    except RequestRejectedError as e:
        raise APIError(str(e), 400) from None
    finally:
        finish(is_complete)
