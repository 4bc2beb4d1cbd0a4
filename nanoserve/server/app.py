"""The OpenAI-compatible HTTP app (FastAPI): its routers, each bound to what it serves with.

`create_app` builds the one `ServedModel` (settings, engine client, tokenizer thread, metrics)
and hands it to each API module, which gives back its routes:

admin.py                /health /ping /load /is_sleeping /version /metrics /v1/models
                        /tokenize /detokenize
openai/completions.py   /v1/completions
openai/chat.py          /v1/chat/completions
openai/responses.py     /v1/responses, GET and DELETE /v1/responses/{id}
request_timeline.py     /v1/requests/{id}/timeline
playground/             / and the page's files; /v1/playground/peers/... (unless disabled)
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from nanoserve import __version__
from nanoserve.client.engine_client import EngineClient
from nanoserve.client.request_timeline import RequestTimelines
from nanoserve.server import admin, request_timeline
from nanoserve.server.auth import ApiKeyMiddleware
from nanoserve.server.config import ServerConfig
from nanoserve.server.cors import CorsMiddleware
from nanoserve.server.errors import ClientDisconnected, install_error_handlers
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.openai import chat, completions, responses
from nanoserve.server.openai.response_store import ResponseStore
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.playground import page, peers
from nanoserve.server.server_load import ServerLoad, ServerLoadMiddleware
from nanoserve.server.tokenizer_pool import TokenizerPool

__all__ = ["ServerConfig", "create_app"]


def create_app(
    config: ServerConfig,
    client: EngineClient,
    tokenizer: PreTrainedTokenizerBase,
    shutdown_timeout_s: float = 5.0,
) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine client and stops it.

    `shutdown_timeout_s` is how long the worker gets to exit once the server stops.
    """
    metrics = ServerMetrics(config.served_model_names[0], client.num_engines)
    pool = TokenizerPool(tokenizer)
    model = ServedModel(config, client, pool, metrics)
    if config.enable_request_timeline or config.enable_playground:
        client.timelines = RequestTimelines()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.on_stats = metrics.update_engine_stats
        client.on_step_tokens = metrics.observe_step
        client.on_ready = metrics.engine_ready
        await client.start()
        try:
            yield
        finally:
            await client.shutdown(shutdown_timeout_s)
            pool.shutdown()

    app = FastAPI(title="nanoserve", version=__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
        metrics.http_requests_client_disconnected.inc()
        return Response(status_code=499)  # nobody is listening any more

    load = ServerLoad()
    app.include_router(admin.router(model, load))
    app.include_router(completions.router(model))
    app.include_router(chat.router(model))
    app.include_router(responses.router(model, ResponseStore()))
    app.include_router(request_timeline.router(model))
    if config.enable_playground:
        app.include_router(page.router(config))
        app.include_router(peers.router(config))
    add_middleware(app, config, load)
    return app


def add_middleware(app: FastAPI, config: ServerConfig, load: ServerLoad) -> None:
    """The API key inside CORS, as the outermost layer: every answer, a 401 and an error
    included, carries the CORS headers a browser needs to read it, and a preflight (`OPTIONS`
    with `Access-Control-Request-Method`) is answered before the key is asked for (as vLLM)."""
    if config.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(
        CorsMiddleware,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
    )
