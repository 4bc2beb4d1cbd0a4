"""A small streaming client of an OpenAI-compatible server (httpx, no torch): `nanoserve chat`
uses it to list models and stream the JSON chunks of completions."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import httpx

CONTEXT_ERROR_PHRASE = "maximum context length"  # in vLLM's and our 400s for a too-long request


class ClientError(Exception):
    """A failure to show as one line: the server is unreachable or answered with an error."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code

    @property
    def is_context_overflow(self) -> bool:
        """The server refused the request because prompt + reply exceed the model's context."""
        return self.status_code == 400 and CONTEXT_ERROR_PHRASE in str(self)


class OpenAIServer:
    """The HTTP side: list models and stream the JSON chunks of a completion."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self.http = self._new_client()

    def _new_client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=self.timeout)

    def reset_connections(self) -> None:
        """Close every connection (the server sees the stream end) and start afresh."""
        self.http.close()
        self.http = self._new_client()

    def close(self) -> None:
        self.http.close()

    def list_models(self) -> list[dict[str, Any]]:
        """The model cards of /v1/models: `id`, and `max_model_len` on vLLM and nanoserve."""
        try:
            response = self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise ClientError(self._describe_transport_error(e)) from None
        if response.status_code >= 400:
            raise ClientError(self._describe_http_error(response), response.status_code)
        try:
            cards = response.json()["data"]
            return [{**card, "id": str(card["id"])} for card in cards]
        except (ValueError, KeyError, TypeError):
            raise ClientError(f"{self.url}/v1/models did not answer with a model list") from None

    def stream(self, path: str, body: dict[str, Any]) -> Generator[dict[str, Any], None, None]:
        """The JSON chunks of an SSE response, up to `data: [DONE]`; closing this closes it."""
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ClientError(self._describe_http_error(response), response.status_code)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank lines between events, comments, other fields
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        message = f"the server sent a frame that is not JSON: {data[:80]!r}"
                        raise ClientError(message) from None
                    if "error" in chunk:
                        raise ClientError(f"server error: {_error_message(chunk)}")
                    yield chunk
        except httpx.HTTPError as e:
            raise ClientError(self._describe_transport_error(e)) from None

    def _describe_transport_error(self, error: httpx.HTTPError) -> str:
        if isinstance(error, httpx.ConnectError):
            reason = str(error).split("] ", 1)[-1] or "connection failed"
            return f"cannot reach {self.url} ({reason}); is the server running? (--url sets it)"
        if isinstance(error, httpx.TimeoutException):
            return f"{self.url} did not answer in time ({type(error).__name__}; see --timeout)"
        return f"the connection to {self.url} failed: {error or type(error).__name__}"

    def _describe_http_error(self, response: httpx.Response) -> str:
        try:
            message = _error_message(response.json())
        except ValueError:
            message = response.text.strip()[:200] or response.reason_phrase
        hint = " (set --api-key or NANOSERVE_API_KEY)" if response.status_code == 401 else ""
        return f"server error {response.status_code}: {message}{hint}"


def _error_message(body: Any) -> str:
    """The message of an OpenAI error body (`{"error": {"message": ...}}`) or FastAPI's."""
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)
    return str(body)
