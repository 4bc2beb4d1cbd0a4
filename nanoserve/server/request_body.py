"""Reading a request's JSON body: media type, size, deadline, strict JSON, then pydantic.

Every way a body can be wrong ends here as an OpenAI-shaped 4xx, before any route logic runs:

- a media type other than JSON (415), a body over `--max-body-bytes` (413) or one that does not
  arrive within `--body-timeout` seconds (408; the connection is closed after the answer);
- JSON nested deeper than MAX_JSON_DEPTH (400), found on the raw text before anything parses
  it (`json_depth.py`), so the answer never depends on the process's recursion limit;
- JSON that Python's parser would take but nothing after it should see (400): lone UTF-16
  surrogates (`"\\ud800"`, which no UTF-8 encoder can write), numbers that are not finite
  (`NaN`, `1e999`), bytes that are not UTF-8. msgspec's decoder rejects each of them and is
  several times faster than `json`, which matters because decoding holds the event loop;
- a shape pydantic refuses (400 naming the field).

A client that goes away while its body is arriving raises `ClientDisconnected`: a disconnect,
not a server error.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from email.message import Message
from typing import TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from nanoserve.server.config import ServerConfig
from nanoserve.server.errors import APIError, ClientDisconnected, validation_error
from nanoserve.server.json_depth import MAX_JSON_DEPTH, is_json_too_deep

T = TypeVar("T", bound=BaseModel)

# The answer to a body that was not read to its end also closes the connection: what is left
# of that body would otherwise be read as the next request.
CLOSE = {"Connection": "close"}
_JSON_DECODER = msgspec.json.Decoder()


def check_media_type(content_type: str | None) -> None:
    """415 unless the body is JSON: `application/json`, `application/*+json`, or no header.

    FastAPI treats a missing Content-Type as JSON too; `curl -d` sends
    `application/x-www-form-urlencoded`, which is refused here with a hint.
    """
    if not content_type:
        return
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    if message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    ):
        return
    raise APIError(
        f"the request body must be JSON (Content-Type: application/json), got "
        f"Content-Type {content_type[:100]!r}",
        415,
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most `max_bytes` (413 past it)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise APIError(
            f"the request body is {length} bytes; the limit is {max_bytes} (--max-body-bytes)",
            413,
            headers=CLOSE,
        )
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise APIError(
                    f"the request body is over the limit of {max_bytes} bytes (--max-body-bytes)",
                    413,
                    headers=CLOSE,
                )
    except ClientDisconnect:
        raise ClientDisconnected from None
    return bytes(body)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside: building millions of small containers (a body of many
    arrays) would otherwise run a collection over all of them every few thousand."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_json_body(body: bytes, model: type[T]) -> T:
    """Strict JSON (UTF-8, no lone surrogates, finite numbers) validated as `model`.

    A 400 names what is wrong. The garbage collector is paused meanwhile, and a refused body's
    objects are freed before it runs again.
    """
    with gc_paused():
        result = _decode_and_validate(body, model)
    if isinstance(result, APIError):
        raise result
    return result


def _decode_and_validate(body: bytes, model: type[T]) -> T | APIError:
    """The model, or the error to answer (returned, not raised: no traceback keeps the body's
    objects alive)."""
    if is_json_too_deep(body):
        return APIError(
            f"the request body is nested too deeply: JSON may nest at most {MAX_JSON_DEPTH} "
            "levels of arrays and objects",
            400,
        )
    try:
        data = _JSON_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return APIError(
            f"the request body is not valid JSON ({e}); it must be UTF-8 JSON with finite "
            "numbers and no lone UTF-16 surrogates such as \\ud800",
            400,
        )
    if not isinstance(data, dict):
        return APIError(f"the request body must be a JSON object, got {type(data).__name__}", 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        return validation_error([dict(error) for error in e.errors()])


async def read_json_body(request: Request, model: type[T], config: ServerConfig) -> T:
    """Read, size-check, parse and validate a JSON object body within the body timeout."""
    check_media_type(request.headers.get("content-type"))
    timeout_s = config.body_timeout_s
    try:
        body = await asyncio.wait_for(read_body(request, config.max_body_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
            408,
            headers=CLOSE,
        ) from None
    return parse_json_body(body, model)
