"""GET /v1/requests/{id}/timeline on a real server: recorded when asked (the playground's header)
or for every request (--enable-request-timeline), a cached prefix shown at admission, the steps
in order, and the same timeline as a Chrome trace."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from servers import InProcessServer

ASK = {"X-Request-Timeline": "true"}
PROMPT = "".join(chr(ord("a") + i % 26) for i in range(300))  # 300 byte tokens


def complete(url: str, headers: dict[str, str] | None = None, **fields) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def timeline(url: str, request_id: str, **params: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/requests/{request_id}/timeline", params=params, timeout=30)


def test_a_request_with_a_cached_prefix_shows_the_hit_then_its_steps(
    server: InProcessServer,
) -> None:
    complete(server.url)  # fills the prefix cache
    answer = complete(server.url, ASK)
    response = timeline(server.url, answer["id"])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == answer["id"] and body["is_finished"]
    (request,) = body["requests"]
    assert request["request_id"] == f"{answer['id']}-0"
    assert (request["num_prompt_tokens"], request["num_output_tokens"]) == (300, 3)
    events = request["events"]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["arrived", "queued", "admitted", "prefill"]
    assert kinds[-1] == "finished" and events[-1]["reason"] == "length"
    assert set(kinds[4:-1]) == {"decode"}
    # Every token of the prompt but the last from the cache: 18 full blocks of 16, then 11 in
    # the partly filled block the first request left (a kept tail).
    assert events[2]["cached_tokens"] == 299
    assert (events[3]["first_position"], events[3]["num_tokens"]) == (299, 1)
    decodes = [e for e in events if e["type"] == "decode"]
    assert sum(e["num_tokens"] for e in decodes) == 3
    assert sum(e["num_steps"] for e in decodes) == 3
    assert all(e["batch_size"] >= 1 for e in decodes)
    times = [e.get("t", e.get("start")) for e in events]
    assert times == sorted(times)  # one clock, in order
    assert PROMPT[:20] not in response.text  # no prompt text in a timeline


def test_the_chrome_trace_has_a_lane_per_request_and_a_span_per_step(
    server: InProcessServer,
) -> None:
    answer = complete(server.url, ASK, n=2, temperature=1.0, seed=1)
    trace = timeline(server.url, answer["id"], format="chrome").json()
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {f"{answer['id']}-0", f"{answer['id']}-1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"].split(" ")[0] for e in spans} >= {"waiting", "prefill", "decode"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert [e["args"]["reason"] for e in events if e["name"] == "finished"] == ["length"] * 2


def test_a_request_that_did_not_ask_is_not_recorded(server: InProcessServer) -> None:
    answer = complete(server.url)
    response = timeline(server.url, answer["id"])
    assert response.status_code == 404
    assert "X-Request-Timeline" in response.json()["error"]["message"]
    assert timeline(server.url, answer["id"], format="svg").status_code == 400


@pytest.fixture(scope="module")
def recording_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    flags = ("--enable-request-timeline", "--disable-playground", "--served-model-name", "tiny")
    with InProcessServer(
        tiny_model, tmp_path_factory.mktemp("log") / "server.log", *flags
    ) as server:
        yield server


def test_enable_request_timeline_records_every_request(recording_server: InProcessServer) -> None:
    answer = complete(recording_server.url)
    assert timeline(recording_server.url, answer["id"]).json()["is_finished"]
    assert httpx.get(f"{recording_server.url}/", timeout=30).status_code == 404  # no page


def test_with_the_playground_off_timelines_are_off(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    flags = ("--disable-playground", "--served-model-name", "tiny")
    with InProcessServer(
        tiny_model, tmp_path_factory.mktemp("log") / "server.log", *flags
    ) as server:
        answer = complete(server.url, ASK)
        response = timeline(server.url, answer["id"])
    assert response.status_code == 404
    assert "request timelines are off" in response.json()["error"]["message"]


def test_a_stop_string_ends_the_timeline_as_stop(server: InProcessServer) -> None:
    first = complete(server.url, max_tokens=8)["choices"][0]["text"]
    stop = first[2:4]  # greedy: the same text again, cut at its third character
    # Room for many more tokens than the stop needs: the engine must not finish by length
    # before the front, which matches stop strings, has aborted the request.
    answer = complete(server.url, ASK, max_tokens=64, stop=[stop])
    assert answer["choices"][0]["finish_reason"] == "stop"
    events = timeline(server.url, answer["id"]).json()["requests"][0]["events"]
    assert events[-1]["type"] == "finished" and events[-1]["reason"] == "stop"
