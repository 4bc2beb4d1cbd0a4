"""The playground's peers, reached through this server: only the page's paths, answers (and
streams) relayed as they are, under this server's API key, a silent peer a 502."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from servers import API_KEY, InProcessServer, free_port

from nanoserve.cli.main import build_parser
from nanoserve.server.config import ServerConfig


@pytest.fixture(scope="module")
def front(server: InProcessServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server whose peers are the shared tiny server and a port where nothing listens."""
    peers = (
        "--playground-peer",
        f"tiny={server.url}/v1/",
        "--playground-peer",
        f"gone=http://127.0.0.1:{free_port()}",
    )
    with InProcessServer(
        tiny_model, tmp_path_factory.mktemp("log") / "server.log", *peers
    ) as front:
        yield front


def relay(front: InProcessServer, peer: str, path: str, **kwargs) -> httpx.Response:
    method = "POST" if "json" in kwargs else "GET"
    url = f"{front.url}/v1/playground/peers/{peer}/{path}"
    return httpx.request(method, url, timeout=60, **kwargs)


def test_the_peers_are_listed_and_their_status_relayed(front: InProcessServer) -> None:
    assert httpx.get(f"{front.url}/v1/playground/peers").json() == {"peers": ["tiny", "gone"]}
    assert relay(front, "tiny", "health").status_code == 200
    assert "vllm:num_requests_running" in relay(front, "tiny", "metrics").text
    models = relay(front, "tiny", "v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]


def test_a_stream_is_relayed_and_a_timeline_asked_for_reaches_the_peer(
    front: InProcessServer,
) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0, "stream": True}
    headers = {"X-Request-Timeline": "true"}
    url = f"{front.url}/v1/playground/peers/tiny/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    request_id = json.loads(lines[0].removeprefix("data: "))["id"]
    timeline = relay(front, "tiny", f"v1/requests/{request_id}/timeline")
    assert timeline.status_code == 200 and timeline.json()["is_finished"]


def test_the_peers_errors_come_back_as_they_are(front: InProcessServer) -> None:
    refused = relay(front, "tiny", "v1/completions", json={"model": "tiny", "prompt": "x", "n": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


@pytest.mark.parametrize(
    ("peer", "path", "method"),
    [
        ("nobody", "health", "GET"),
        ("tiny", "v1/responses", "POST"),
        ("tiny", "tokenize", "POST"),
        ("tiny", "v1/completions", "GET"),
        ("tiny", "v1/requests/../../health/timeline", "GET"),
    ],
)
def test_only_the_pages_paths_pass(front: InProcessServer, peer: str, path: str, method: str):
    response = httpx.request(method, f"{front.url}/v1/playground/peers/{peer}/{path}", json={})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == 404


def test_a_peer_that_does_not_answer_is_a_502(front: InProcessServer) -> None:
    response = relay(front, "gone", "health")
    assert response.status_code == 502
    assert "the playground peer 'gone' did not answer" in response.json()["error"]["message"]


def test_the_peers_are_behind_this_servers_api_key(
    server: InProcessServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    flags = ("--api-key", API_KEY, "--playground-peer", f"tiny={server.url}")
    with InProcessServer(
        tiny_model, tmp_path_factory.mktemp("log") / "server.log", *flags
    ) as front:
        assert relay(front, "tiny", "health").status_code == 401
        authorized = {"Authorization": f"Bearer {API_KEY}"}
        assert relay(front, "tiny", "health", headers=authorized).status_code == 200


def test_the_peer_flag_takes_name_equals_url() -> None:
    args = build_parser().parse_args(
        ["serve", "--playground-peer", "vllm=http://h:1/v1", "--playground-peer", "b=http://h:2/"]
    )
    assert args.playground_peer == [("vllm", "http://h:1"), ("b", "http://h:2")]


@pytest.mark.parametrize(
    ("peers", "message"),
    [
        ((("a b", "http://h:1"),), "letters, digits"),
        ((("nanoserve", "http://h:1"),), "letters, digits"),
        ((("a", "http://h:1"), ("a", "http://h:2")), "named twice"),
        ((("a", "file:///etc/passwd"),), "needs an http:// or https:// URL"),
    ],
)
def test_bad_peers_are_refused_at_start_up(peers, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(model="m", served_model_names=("m",), playground_peers=peers)
