"""ServerConfig: what the HTTP front needs beyond the engine (names, limits, timeouts, the key,
CORS).

Light to import: the command line reads its defaults for its flags before anything heavy loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nanoserve.server.openai.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP front needs beyond the engine: names, limits, timeouts, the API key, CORS."""

    model: str  # the checkpoint path or hub id, shown as `root` in /v1/models
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    # None: max_model_len × the longest token's characters (no longer prompt can fit).
    max_prompt_chars: int | None = None
    trust_request_chat_template: bool = False
    header_timeout_s: float = 30.0  # a connection's request line and headers
    body_timeout_s: float = 60.0  # a request's whole body, once its headers are in
    send_timeout_s: float = 60.0  # a client that reads nothing while its send buffer is full
    tool_call_parser: str | None = None  # reads tool calls for tool_choice "auto"
    # CORS, as vLLM's flags set it: every origin, method and header, no credentials.
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_server_load_tracking: bool = False  # /load counts requests in generation routes
    # Request timelines (GET /v1/requests/{id}/timeline): of every request with this, else
    # only of those that ask (the playground's header), while the playground is on.
    enable_request_timeline: bool = False
    enable_playground: bool = True  # the page at /
    # Other OpenAI-compatible servers the playground races against: (name, base URL) pairs,
    # reached through this server (/v1/playground/peers/{name}/...).
    playground_peers: tuple[tuple[str, str], ...] = ()
    enable_auto_tool_choice: bool = False
    # Sampling fields a request leaves unset take these (the model's generation_config.json
    # under --generation-config auto; see checkpoint.load_generation_defaults), then ours.
    default_sampling: Mapping[str, Any] = field(default_factory=dict)

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
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be ≥ 1, got {self.max_body_bytes}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be ≥ 1, got {self.max_prompt_chars}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if not all(isinstance(value, str) for value in values):
                raise ValueError(f"{name} must be a list of strings, got {list(values)!r}")
        check_playground_peers(self.playground_peers)
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


PEER_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def check_playground_peers(peers: tuple[tuple[str, str], ...]) -> None:
    """Each peer: a name of letters, digits, '-', '_' or '.', used once, and an http(s) URL."""
    names = [name for name, _ in peers]
    for name, url in peers:
        if not name or not set(name) <= PEER_NAME_CHARS or name == "nanoserve":
            raise ValueError(
                f"a playground peer's name is letters, digits, '-', '_' or '.' (and not "
                f"'nanoserve', this server's column), got {name!r}"
            )
        if names.count(name) > 1:
            raise ValueError(f"the playground peer {name!r} is named twice")
        if not url.startswith(("http://", "https://")) or len(url) < 10:
            raise ValueError(
                f"the playground peer {name!r} needs an http:// or https:// URL, got {url!r}"
            )
