"""The routes around generation: one model by its id, and requests that name no model."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from servers import InProcessServer, read_metrics


@pytest.mark.parametrize("name", ["tiny", "tiny-alias"])
def test_a_served_model_by_its_id(server: InProcessServer, name: str) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve(name)
    assert (model.id, model.object, model.owned_by) == (name, "model", "nanoserve")
    assert model.model_extra["max_model_len"] == 1024
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    by_id = httpx.get(f"{server.url}/v1/models/{name}", timeout=10).json()
    card = next(card for card in listed if card["id"] == name)
    assert {**by_id, "created": 0} == {**card, "created": 0}  # created: the time of the request


@pytest.mark.parametrize("model_id", ["gpt-4o", "Qwen/Qwen3-1.7B", "tiny/extra"])
def test_an_unknown_model_id_is_a_404_in_openai_shape(server: InProcessServer, model_id) -> None:
    response = httpx.get(f"{server.url}/v1/models/{model_id}", timeout=10)
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": f"The model `{model_id}` does not exist.",
            "type": "not_found_error",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("model", ["", None], ids=["empty", "missing"])
def test_a_request_without_a_model_name_is_served_by_the_default(
    server: InProcessServer, path: str, model: str | None
) -> None:
    body: dict = {"max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {})
    body.update({"prompt": "hi"} if "chat" not in path else {})
    if model is not None:
        body["model"] = model
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if path != "/tokenize":
        assert response.json()["model"] == "tiny"


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_health(server: InProcessServer, method: str) -> None:
    response = httpx.request(method, f"{server.url}/ping", timeout=10)
    assert (response.status_code, response.content) == (200, b"")


def test_is_sleeping_is_false(server: InProcessServer) -> None:
    assert httpx.get(f"{server.url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}


def current_load(url: str) -> int:
    return httpx.get(f"{url}/load", timeout=10).json()["server_load"]


def wait_for_load(url: str, expected: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (load := current_load(url)) != expected:
        assert time.monotonic() < deadline, f"/load is {load}, not {expected}"
        time.sleep(0.05)


def unread_stream(port: int) -> socket.socket:
    """A streamed completion whose client reads nothing (a small receive buffer): its answer
    stays in flight until the socket closes."""
    body = {"prompt": "hi", "max_tokens": 900, "n": 4, "ignore_eos": True, "stream": True}
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_load_is_zero_without_tracking(server: InProcessServer) -> None:
    sock = unread_stream(server.port)
    wait_for_load(server.url, 0)  # as vLLM without the flag
    time.sleep(0.5)  # the stream runs meanwhile
    assert current_load(server.url) == 0
    sock.close()
    deadline = time.monotonic() + 60  # the shared server is idle again for the next test
    while read_metrics(server.url)["vllm:num_requests_running"]:
        assert time.monotonic() < deadline, "the closed stream was never aborted"
        time.sleep(0.05)


def test_load_counts_generation_requests_in_flight(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("log") / "server.log"
    with InProcessServer(tiny_model, log, "--enable-server-load-tracking") as server:
        assert current_load(server.url) == 0
        sockets = [unread_stream(server.port) for _ in range(2)]
        wait_for_load(server.url, 2)
        httpx.get(f"{server.url}/v1/models", timeout=10)  # not a generation route
        assert current_load(server.url) == 2
        sockets.pop().close()
        wait_for_load(server.url, 1)
        sockets.pop().close()
        wait_for_load(server.url, 0)


def test_detokenize_takes_twice_the_context_per_call(server: InProcessServer) -> None:
    # The tiny model holds 1024 tokens; 6 million ids were once decoded into a 263 MiB answer.
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "ab" * 1024}, timeout=30)
    tokens = ids.json()["tokens"][-2048:]
    assert len(tokens) == 2048
    whole = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30)
    assert whole.status_code == 200 and whole.json()["prompt"].endswith("ab" * 100)
    refused = httpx.post(f"{server.url}/detokenize", json={"tokens": [5] * 2049}, timeout=30)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "tokens", error
    assert "2049 token ids" in error["message"] and "at most 2048" in error["message"], error
