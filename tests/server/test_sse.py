"""Every stream ends the same way: whatever stops its chunks after the 200 (a refused request,
a dead engine, a bug) becomes one error frame in OpenAI's shape, then `data: [DONE]`; and the
engine client's errors map onto HTTP in one place."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel

from nanoserve.client.engine_client import EngineDeadError, RequestRejectedError
from nanoserve.server.errors import APIError, engine_error
from nanoserve.server.sse import SSE_DONE, NamedEvent, sse_frame, sse_stream


class Chunk(BaseModel):
    text: str


async def chunks_then(error: BaseException | None) -> AsyncIterator[BaseModel | NamedEvent]:
    yield Chunk(text="a")
    yield NamedEvent("response.created", {"n": 1})
    if error is not None:
        raise error


def frames(error: BaseException | None) -> list[str]:
    async def collect() -> list[str]:
        return [frame async for frame in sse_stream(chunks_then(error))]

    return asyncio.run(collect())


def test_a_stream_frames_its_chunks_and_ends_with_done() -> None:
    assert frames(None) == [
        'data: {"text":"a"}\n\n',
        'event: response.created\ndata: {"n": 1}\n\n',
        SSE_DONE,
    ]


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (APIError("max_tokens is too large", 400, "max_tokens"), 400, "max_tokens is too large"),
        (EngineDeadError("the model worker failed (exit code 9)"), 503, "exit code 9"),
        (RequestRejectedError("invalid structured output regex: x"), 400, "regex: x"),
        (KeyError("a bug"), 500, "internal server error: KeyError"),
    ],
    ids=["api error", "engine dead", "engine refused", "bug"],
)
def test_every_failure_after_the_first_frame_is_an_error_frame_then_done(
    error: Exception, code: int, message: str
) -> None:
    *chunks, error_frame, done = frames(error)
    assert len(chunks) == 2 and done == SSE_DONE
    assert error_frame.startswith("data: ") and error_frame.endswith("\n\n")
    body = json.loads(error_frame.removeprefix("data: "))["error"]
    assert body["code"] == code and message in body["message"]


def test_a_cancelled_stream_is_not_turned_into_a_frame() -> None:
    with pytest.raises(asyncio.CancelledError):
        frames(asyncio.CancelledError())


def test_engine_errors_map_to_503_to_retry_or_400_naming_the_field() -> None:
    dead = engine_error(EngineDeadError("the server is shutting down"))
    assert dead.status_code == 503 and dead.headers == {"Retry-After": "1"}
    refused = engine_error(RequestRejectedError("bad grammar"), "response_format")
    assert (refused.status_code, refused.param, refused.message) == (
        400,
        "response_format",
        "bad grammar",
    )


def test_a_frame_is_one_event() -> None:
    assert sse_frame({"a": 1}) == 'data: {"a": 1}\n\n'
