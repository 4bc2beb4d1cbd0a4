"""The HTTP routes of the OpenAI-compatible server (FastAPI), and how a request's life ends.

Bodies are read and parsed here (size limit, JSON, pydantic) so that every client mistake is a
400 in OpenAI's shape. A client that goes away — streaming or not — has its engine requests
aborted at once and is counted in `vllm:http_requests_client_disconnected_total`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from nanoserve import __version__
from nanoserve.server.engine_client import EngineClient, EngineDeadError, RequestRejectedError
from nanoserve.server.errors import APIError, error_body, install_error_handlers, validation_error
from nanoserve.server.metrics import CONTENT_TYPE, ServerMetrics
from nanoserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from nanoserve.server.serving import RETRY_AFTER_S, OpenAIServing, RequestRun, sse_stream
from nanoserve.tokenizer import apply_chat_template

T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP front needs beyond the engine: names, limits, the API key."""

    model: str  # the checkpoint path or hub id, shown as `root` in /v1/models
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_body_bytes: int = 32 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be ≥ 1, got {self.max_waiting_requests}")


class ClientDisconnected(Exception):
    """The client closed its connection before the response was ready."""


class EventStreamResponse(StreamingResponse):
    """An SSE response that always calls `on_close(is_complete)`, however the stream ends.

    Starlette cancels the body iterator when the client disconnects; the callback then runs
    even if the iterator never started.
    """

    def __init__(self, frames: AsyncIterator[str], on_close: Callable[[bool], None]) -> None:
        self._is_complete = False

        async def track() -> AsyncIterator[str]:
            async for frame in frames:
                yield frame
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


async def wait_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


async def read_json_body(request: Request, model: type[T], max_bytes: int) -> T:
    """Read, size-check, parse and validate a JSON object body."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise APIError(f"the request body is {length} bytes; the limit is {max_bytes}", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(f"the request body is over the limit of {max_bytes} bytes", 413)
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400) from None
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}", 400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def create_app(
    config: ServerConfig,
    client: EngineClient,
    tokenizer,
    shutdown_timeout_s: float = 5.0,
) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine client and stops it."""
    metrics = ServerMetrics(config.served_model_names[0])
    serving = OpenAIServing(
        client, tokenizer, metrics, list(config.served_model_names), config.max_waiting_requests
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.on_stats = metrics.update_engine_stats
        await client.start()
        try:
            yield
        finally:
            await client.shutdown(shutdown_timeout_s)

    app = FastAPI(title="nanoserve", version=__version__, lifespan=lifespan)
    app.state.client = client
    app.state.metrics = metrics
    app.state.serving = serving
    install_error_handlers(app)

    def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        is_valid = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), config.api_key.encode()
        )
        if not is_valid:
            raise APIError(
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )

    def finish(run: RequestRun, is_complete: bool) -> None:
        run.close()
        if not is_complete:
            metrics.http_requests_client_disconnected.inc()

    async def respond(
        request: Request,
        run: RequestRun,
        stream: bool,
        chunks: Callable[[], AsyncIterator[BaseModel]],
        whole: Callable[[], Awaitable[BaseModel]],
    ) -> Response:
        if stream:
            return EventStreamResponse(
                sse_stream(chunks()), on_close=lambda is_complete: finish(run, is_complete)
            )
        is_complete = True
        try:
            return json_response(await wait_unless_disconnected(request, whole()))
        except ClientDisconnected:
            is_complete = False
            return Response(status_code=499)  # nobody is listening any more
        except EngineDeadError as e:
            raise APIError(str(e), 503, headers={"Retry-After": RETRY_AFTER_S}) from None
        except RequestRejectedError as e:
            raise APIError(str(e), 400) from None
        finally:
            finish(run, is_complete)

    @app.get("/health")
    async def health() -> Response:
        if not client.is_ready:
            return JSONResponse(error_body("the model worker is not ready", 503), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_api_key(request)
        max_model_len = client.info.max_model_len if client.info is not None else 0
        cards = [
            ModelCard(id=name, root=config.model, max_model_len=max_model_len)
            for name in config.served_model_names
        ]
        return json_response(ModelList(data=cards))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_api_key(request)
        body = await read_json_body(request, CompletionRequest, config.max_body_bytes)
        run, texts = serving.start_completion(body)
        return await respond(
            request,
            run,
            body.stream,
            lambda: serving.completion_chunks(body, run, texts),
            lambda: serving.completion(body, run, texts),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_api_key(request)
        body = await read_json_body(request, ChatCompletionRequest, config.max_body_bytes)
        run = serving.start_chat(body)
        return await respond(
            request,
            run,
            body.stream,
            lambda: serving.chat_chunks(body, run),
            lambda: serving.chat(body, run),
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        check_api_key(request)
        body = await read_json_body(request, TokenizeRequest, config.max_body_bytes)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages", 400, "prompt")
        if body.prompt is not None:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            try:
                tokens = apply_chat_template(
                    tokenizer,
                    [m.model_dump(exclude_none=True) for m in body.messages],
                    add_generation_prompt=body.add_generation_prompt,
                    **(body.chat_template_kwargs or {}),
                )
            except Exception as e:  # a template error caused by the client's messages
                raise APIError(f"could not apply the chat template: {e}", 400, "messages") from e
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        check_api_key(request)
        body = await read_json_body(request, DetokenizeRequest, config.max_body_bytes)
        serving.check_model(body.model)
        limit = serving.num_token_ids
        bad = [t for t in body.tokens if not 0 <= t < limit]
        if bad:
            raise APIError(f"token ids must be in [0, {limit}), got {bad[:5]}", 400, "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app
