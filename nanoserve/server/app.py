"""The OpenAI-compatible HTTP app (FastAPI): its state, its routes and its lifespan.

admin.py         /health /version /metrics /v1/models /tokenize /detokenize
completions.py   /v1/completions
chat.py          /v1/chat/completions
responses.py     /v1/responses, GET and DELETE /v1/responses/{id}
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from nanoserve import __version__
from nanoserve.server import admin, chat, completions, responses
from nanoserve.server.engine_client import EngineClient
from nanoserve.server.errors import install_error_handlers
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.response_store import ResponseStore
from nanoserve.server.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "create_app"]


def create_app(
    config: ServerConfig,
    client: EngineClient,
    tokenizer,
    shutdown_timeout_s: float = 5.0,
) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine client and stops it."""
    metrics = ServerMetrics(config.served_model_names[0])
    serving_args = (
        client, tokenizer, metrics, list(config.served_model_names), config.max_waiting_requests
    )  # fmt: skip
    chat_serving = chat.ChatServing(
        *serving_args,
        tool_call_parser=config.tool_call_parser,
        enable_auto_tool_choice=config.enable_auto_tool_choice,
    )
    state = ServerState(
        config=config,
        client=client,
        tokenizer=tokenizer,
        metrics=metrics,
        completions=completions.CompletionServing(*serving_args),
        chat=chat_serving,
        responses=responses.ResponsesServing(chat_serving, ResponseStore()),
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
    app.state.server = state
    install_error_handlers(app)
    for module in (admin, completions, chat, responses):
        app.include_router(module.router)
    return app
