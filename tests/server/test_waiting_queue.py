"""A full waiting queue: new requests get 503 with Retry-After, and the server recovers. Every
choice of every prompt counts against the queue, so no single request can get around it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import InProcessServer, ServerProcess, read_metrics

MAX_WAITING = 2
LONG = {"max_tokens": 900, "ignore_eos": True, "stream": True}  # ≥ 10 s of decode each


@pytest.fixture(scope="module")
def queue_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessServer]:
    """One running sequence at a time, at most MAX_WAITING requests waiting for a first token."""
    server = InProcessServer(
        tiny_model, tmp_path_factory.mktemp("queue") / "server.log",
        "--max-num-seqs", "1", "--max-waiting-requests", str(MAX_WAITING),
    )  # fmt: skip
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def wait_until_idle(url: str, timeout_s: float) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is used; the last metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics(url)
        busy = [
            name
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            if metrics[f"vllm:{name}"] != 0
        ]
        if not busy:
            return metrics
        assert time.monotonic() < deadline, f"{busy} not 0 after {timeout_s} s: {metrics}"
        time.sleep(0.02)


class Outcome:
    """What one streamed request saw: its status, and for a refusal its headers and body."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.body: dict | None = None
        self.first_frame = asyncio.Event()


async def stream(client: httpx.AsyncClient, url: str, prompt: str, outcome: Outcome) -> None:
    """Stream a long completion until cancelled (which closes the connection)."""
    body = {**LONG, "prompt": prompt}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            outcome.body = response.json()
        # Set last, once the whole answer is in: the flood waits for every status to be known.
        outcome.status, outcome.headers = response.status_code, response.headers
        if response.status_code != 200:
            return
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                outcome.first_frame.set()


def engine_counts(url: str) -> dict[str, float]:
    metrics = read_metrics(url)
    return {name: metrics[f"vllm:num_requests_{name}"] for name in ("running", "waiting")}


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        await asyncio.sleep(0.02)


async def flood(url: str, num_flood: int) -> tuple[Outcome, list[Outcome]]:
    """One request running, then `num_flood` more at once; cancels all of them at the end."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        running = Outcome()
        tasks = [asyncio.create_task(stream(client, url, "running", running))]
        try:
            await asyncio.wait_for(running.first_frame.wait(), timeout=30)
            flooded = [Outcome() for _ in range(num_flood)]
            tasks += [
                asyncio.create_task(stream(client, url, f"flood {i}", outcome))
                for i, outcome in enumerate(flooded)
            ]
            # Refusals answer at once; the accepted ones have their 200 headers but no token.
            await wait_for(
                lambda: all(o.status is not None for o in flooded), 30, "every request answered"
            )
            # /metrics shows the worker's counts as of its last step: wait for the one after
            # the accepted requests reached it.
            expected = {"running": 1, "waiting": MAX_WAITING}
            await wait_for(lambda: engine_counts(url) == expected, 10, f"{expected} on /metrics")
            assert not any(o.first_frame.is_set() for o in flooded)  # one sequence at a time
        finally:
            for task in tasks:
                task.cancel()  # closes every connection: running and waiting are aborted
            await asyncio.gather(*tasks, return_exceptions=True)
    return running, flooded


def test_full_waiting_queue_answers_503_then_recovers(queue_server: InProcessServer) -> None:
    url = queue_server.url
    running, flooded = asyncio.run(flood(url, num_flood=5))

    assert running.status == 200
    # The first MAX_WAITING requests wait; the rest are refused, each in OpenAI's error shape.
    assert [o.status for o in flooded].count(200) == MAX_WAITING
    refused = [o for o in flooded if o.status != 200]
    assert len(refused) == 3
    for outcome in refused:
        assert outcome.status == 503
        assert outcome.headers["retry-after"] == "1"
        assert outcome.headers["content-type"].startswith("application/json")
        error = outcome.body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "service_unavailable_error" and error["code"] == 503
        assert error["param"] is None
        assert f"--max-waiting-requests {MAX_WAITING}" in error["message"]

    # Closing the connections aborted the running and the waiting requests alike.
    wait_until_idle(url, timeout_s=5.0)

    # Healthy, and the front's count of waiting requests is back to 0: two requests at once are
    # both accepted (a count left over from the aborted ones would refuse the second).
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200

    async def two_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "ok", "max_tokens": 4, "ignore_eos": True}
            return await asyncio.gather(
                *(client.post(f"{url}/v1/completions", json=body) for _ in range(MAX_WAITING))
            )

    for response in asyncio.run(two_at_once()):
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    wait_until_idle(url, timeout_s=5.0)


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_request_larger_than_the_queue_is_400(queue_server: InProcessServer) -> None:
    url = queue_server.url
    for body, param in (
        ({"prompt": [[1], [2], [3]], "max_tokens": 1}, "prompt"),
        ({"prompt": "a", "n": MAX_WAITING + 1, "max_tokens": 1}, "n"),
        ({"prompt": ["a", "b"], "n": 2, "max_tokens": 1}, "n"),
    ):
        response = post(url, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (
            error["param"] == param and f"--max-waiting-requests {MAX_WAITING}" in error["message"]
        )
    assert engine_counts(url) == {"running": 0, "waiting": 0}


def front_rss_bytes(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_three_million_prompts_queue_nothing(front_process: ServerProcess) -> None:
    url = front_process.url  # what is measured is the memory of the front process
    started = time.monotonic()
    response = post(url, {"prompt": [[5]] * 3_000_000, "max_tokens": 1})
    assert response.status_code == 400 and "at most 2048 prompts" in response.text
    assert time.monotonic() - started < 30
    assert engine_counts(url) == {"running": 0, "waiting": 0}
    assert front_rss_bytes(front_process) < 1.5 * 2**30  # it reached 6.4 GB before the cap


def test_prompts_times_n_count_against_the_free_room(queue_server: InProcessServer) -> None:
    async def scenario() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            running, waiting = Outcome(), Outcome()
            url = queue_server.url
            tasks = [asyncio.create_task(stream(client, url, "running", running))]
            try:
                await asyncio.wait_for(running.first_frame.wait(), timeout=30)
                tasks.append(asyncio.create_task(stream(client, url, "waiting", waiting)))
                await wait_for(lambda: waiting.status is not None, 30, "the second answered")
                body = {"prompt": [[1], [2]], "max_tokens": 1}  # 1 waiting + 2 > 2
                two = await client.post(f"{url}/v1/completions", json=body)
                body = {"prompt": [[1]], "max_tokens": 1, "stream": True}  # 1 + 1 fits
                async with client.stream("POST", f"{url}/v1/completions", json=body) as one:
                    return two.status_code, one.status_code
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    assert asyncio.run(scenario()) == (503, 200)
    wait_until_idle(queue_server.url, timeout_s=10.0)
