"""The API key guards what vLLM's guards: every path under /v1, and nothing else."""

from __future__ import annotations

import httpx
import pytest
from servers import API_KEY, InProcessServer

from nanoserve.server.auth import is_guarded

GOOD = {"Authorization": f"Bearer {API_KEY}"}
OPEN_GETS = ["/health", "/version", "/metrics", "/docs", "/redoc", "/openapi.json"]
GUARDED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "H", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "H"}]}),
    ("GET", "/v1/nothing-here", None),  # unknown, but under /v1: 401, as in vLLM
]


def test_guarded_paths() -> None:
    assert all(map(is_guarded, ["/v1/models", "/v1/completions", "/v1", "/v1/x/y"]))
    assert not any(map(is_guarded, ["/health", "/metrics", "/tokenize", "/docs", "/v2/x"]))


@pytest.mark.parametrize("path", OPEN_GETS)
def test_open_routes_need_no_key(cycle_server: InProcessServer, path: str) -> None:
    assert httpx.get(f"{cycle_server.url}{path}", timeout=30).status_code == 200


def test_tokenize_and_detokenize_need_no_key(cycle_server: InProcessServer) -> None:
    url = cycle_server.url
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hi"}, timeout=30).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text == "Hi"


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}, {"X-Api-Key": API_KEY}],
    ids=["no header", "wrong key", "no scheme", "other header"],
)
def test_v1_needs_the_key(
    cycle_server: InProcessServer, method: str, path: str, body, headers: dict
) -> None:
    response = httpx.request(method, f"{cycle_server.url}{path}", json=body, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == 401 and error["type"] == "authentication_error"
    assert API_KEY not in response.text


@pytest.mark.parametrize(("method", "path", "body"), GUARDED[:3])
def test_v1_with_the_key(cycle_server: InProcessServer, method: str, path: str, body) -> None:
    url = f"{cycle_server.url}{path}"
    assert httpx.request(method, url, json=body, headers=GOOD, timeout=30).status_code == 200
    lower = {"Authorization": f"bearer {API_KEY}"}  # the scheme is case-insensitive
    assert httpx.request(method, url, json=body, headers=lower, timeout=30).status_code == 200


def test_the_key_is_never_logged(cycle_server: InProcessServer) -> None:
    httpx.get(f"{cycle_server.url}/v1/models", headers={"Authorization": "Bearer wrong-key-xyz"})
    log = cycle_server.log_path.read_text(errors="replace")
    assert API_KEY not in log and "wrong-key-xyz" not in log
