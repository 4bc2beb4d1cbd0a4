"""What every route needs: the server's settings and the objects it serves with."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from nanoserve.server.engine_client import EngineClient
from nanoserve.server.errors import APIError
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:  # the endpoint modules import this one
    from transformers import PreTrainedTokenizerBase

    from nanoserve.server.chat import ChatServing
    from nanoserve.server.completions import CompletionServing
    from nanoserve.server.responses import ResponsesServing


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP front needs beyond the engine: names, limits, the API key."""

    model: str  # the checkpoint path or hub id, shown as `root` in /v1/models
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    tool_call_parser: str | None = None  # reads tool calls for tool_choice "auto"
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be ≥ 1, got {self.max_waiting_requests}")


@dataclass
class ServerState:
    """The objects one server's routes share (kept in `app.state.server`)."""

    config: ServerConfig
    client: EngineClient
    tokenizer: PreTrainedTokenizerBase
    metrics: ServerMetrics
    completions: CompletionServing
    chat: ChatServing
    responses: ResponsesServing

    def check_api_key(self, request: Request) -> None:
        """401 unless the request carries `Authorization: Bearer <the key>` (when one is set)."""
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        is_valid = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.config.api_key.encode()
        )
        if not is_valid:
            raise APIError(
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )


def server_state(request: Request) -> ServerState:
    return request.app.state.server
