"""Server-sent events: the frames of every streamed answer, and how every stream ends.

A stream sends its 200 and its headers before the first chunk exists, so a failure after that
cannot change the status: `sse_stream` ends every stream the same way instead, whatever stopped
its chunks, with an error frame in OpenAI's shape (`data: {"error": {...}}`) and then
`data: [DONE]`. `EventStreamResponse` tells its owner, however the stream ended, whether the
client read it to the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from nanoserve.server.errors import ENGINE_ERRORS, APIError, engine_error, error_body

logger = logging.getLogger("nanoserve.server")

SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class NamedEvent:
    """An event with an `event:` name (the Responses API's typed events)."""

    name: str
    data: dict[str, Any]


def sse_frame(payload: BaseModel | dict[str, Any] | NamedEvent) -> str:
    """One server-sent event: [`event: <name>`,] `data: <json>` and the blank line ending it."""
    if isinstance(payload, NamedEvent):
        return f"event: {payload.name}\ndata: {json.dumps(payload.data)}\n\n"
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel | NamedEvent]) -> AsyncIterator[str]:
    """Frame `chunks` as SSE; whatever ends them early becomes an error frame; then DONE.

    A client that goes away cancels the stream (CancelledError is no Exception: it passes).
    """
    try:
        async for chunk in chunks:
            yield sse_frame(chunk)
    except APIError as e:
        yield sse_frame(e.body())
    except ENGINE_ERRORS as e:
        yield sse_frame(engine_error(e).body())
    except Exception as e:  # a bug: logged; the client still gets a well-formed end
        logger.exception("a stream failed after its first frame")
        yield sse_frame(error_body(f"internal server error: {type(e).__name__}", 500))
    yield SSE_DONE


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
