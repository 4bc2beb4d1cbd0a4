"""The routes around generation: health (/health, /ping), load (/load, /is_sleeping), version,
metrics, models, tokenize and detokenize."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nanoserve import __version__
from nanoserve.server.errors import APIError, error_body
from nanoserve.server.metrics import CONTENT_TYPE
from nanoserve.server.openai.api_models import (
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from nanoserve.server.openai.chat_prompt import check_template_kwargs, render_messages
from nanoserve.server.openai.checks import (
    check_model,
    check_num_detokenized,
    check_prompt_chars,
    check_token_ids,
)
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.server.server_load import ServerLoad


def router(model: ServedModel, load: ServerLoad) -> APIRouter:
    """Health, load, version, metrics, the model list, tokenize and detokenize, for `model`."""
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> Response:
        if not model.client.is_ready:
            return JSONResponse(error_body("the model worker is not ready", 503), status_code=503)
        return Response(status_code=200)

    # vLLM's SageMaker-style health check: /health under another name, GET or POST.
    for method in ("GET", "POST"):
        routes.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method}")

    @routes.get("/load")
    async def server_load() -> dict[str, int]:
        """Generation requests in flight (always 0 without --enable-server-load-tracking)."""
        return {"server_load": load.num_in_flight}

    @routes.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": False}  # there is no sleep mode: the weights stay loaded

    @routes.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @routes.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(model.metrics.render(), media_type=CONTENT_TYPE)

    @routes.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(ModelList(data=model_cards(model)).model_dump(mode="json"))

    @routes.get("/v1/models/{model_id:path}")  # hub names have a slash: Qwen/Qwen3-1.7B
    async def model_card(model_id: str) -> Response:
        for card in model_cards(model):
            if card.id == model_id:
                return JSONResponse(card.model_dump(mode="json"))
        raise APIError(f"The model `{model_id}` does not exist.", 404, "model")

    @routes.post("/tokenize", openapi_extra=json_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        body = await read_json_body(request, TokenizeRequest, model.config)
        return json_answer(await tokenized(model, body))

    @routes.post("/detokenize", openapi_extra=json_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        body = await read_json_body(request, DetokenizeRequest, model.config)
        check_model(model, body.model)
        check_num_detokenized(model, len(body.tokens), "tokens")
        check_token_ids(model, body.tokens, "tokens")
        return json_answer({"prompt": await model.pool.decode(body.tokens)})

    return routes


def json_answer(content: dict[str, Any]) -> Response:
    """A JSON answer encoded in one native pass: FastAPI's own encoder walks a list of token ids
    in Python, one id at a time, on the event loop."""
    return Response(msgspec.json.encode(content), media_type="application/json")


def model_cards(model: ServedModel) -> list[ModelCard]:
    """One card per served name."""
    info = model.client.info
    return [
        ModelCard(id=name, root=model.config.model, max_model_len=info.max_model_len if info else 0)
        for name in model.config.served_model_names
    ]


async def tokenized(model: ServedModel, body: TokenizeRequest) -> dict[str, Any]:
    """/tokenize's answer: a prompt's tokens, or chat messages' through the chat template."""
    check_model(model, body.model)
    if body.prompt is not None and body.messages is None:
        check_prompt_chars(model, len(body.prompt), "prompt")
        tokens = await model.pool.encode(body.prompt, body.add_special_tokens)
    elif body.messages is not None and body.prompt is None:
        tokens = await render_messages(
            model,
            body.messages,
            body.add_generation_prompt,
            body.chat_template,
            check_template_kwargs(body.chat_template_kwargs),
        )
    else:
        raise APIError("give exactly one of prompt or messages", 400, "prompt")
    return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}
