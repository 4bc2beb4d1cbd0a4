"""The routes around generation: health, version, metrics, models, tokenize and detokenize."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nanoserve import __version__
from nanoserve.server.errors import APIError, error_body
from nanoserve.server.http import json_response
from nanoserve.server.metrics import CONTENT_TYPE
from nanoserve.server.openai.api_models import (
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from nanoserve.server.openai.chat_prompt import check_template_kwargs
from nanoserve.server.openapi import json_body_schema
from nanoserve.server.request_body import read_json_body
from nanoserve.server.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    if not server_state(request).client.is_ready:
        return JSONResponse(error_body("the model worker is not ready", 503), status_code=503)
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


def model_cards(state: ServerState) -> list[ModelCard]:
    """One card per served name."""
    info = state.client.info
    return [
        ModelCard(id=name, root=state.config.model, max_model_len=info.max_model_len if info else 0)
        for name in state.config.served_model_names
    ]


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = server_state(request)
    return json_response(ModelList(data=model_cards(state)))


@router.get("/v1/models/{model_id:path}")  # hub names have a slash: Qwen/Qwen3-1.7B
async def model(request: Request, model_id: str) -> Response:
    for card in model_cards(server_state(request)):
        if card.id == model_id:
            return json_response(card)
    raise APIError(f"The model `{model_id}` does not exist.", 404, "model")


@router.post("/tokenize", openapi_extra=json_body_schema(TokenizeRequest))
async def tokenize(request: Request) -> dict[str, Any]:
    state = server_state(request)
    body = await read_json_body(request, TokenizeRequest, state.config)
    serving = state.chat
    serving.check_model(body.model)
    if body.prompt is not None and body.messages is None:
        serving.check_prompt_chars(len(body.prompt), "prompt")
        tokens = await state.pool.encode(body.prompt, body.add_special_tokens)
    elif body.messages is not None and body.prompt is None:
        tokens = await serving.render(
            body.messages,
            body.add_generation_prompt,
            body.chat_template,
            check_template_kwargs(body.chat_template_kwargs),
        )
    else:
        raise APIError("give exactly one of prompt or messages", 400, "prompt")
    return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}


@router.post("/detokenize", openapi_extra=json_body_schema(DetokenizeRequest))
async def detokenize(request: Request) -> dict[str, Any]:
    state = server_state(request)
    body = await read_json_body(request, DetokenizeRequest, state.config)
    state.completions.check_model(body.model)
    limit = state.completions.num_token_ids
    bad = [t for t in body.tokens if not 0 <= t < limit]
    if bad:
        raise APIError(f"token ids must be in [0, {limit}), got {bad[:5]}", 400, "tokens")
    return {"prompt": await state.pool.decode(body.tokens)}
