"""The measuring client: streamed /v1/completions requests over httpx, timed chunk by chunk.

Definitions (the ones vLLM's and SGLang's serving benchmarks use):

- time to first token (TTFT): request sent → first SSE chunk whose `choices` is non-empty;
- inter-token latency (ITL): gaps between successive chunks that carry text;
- time per output token (TPOT): (e2e − TTFT) / (output tokens − 1);
- output tokens: `usage.completion_tokens` of the final chunk (asked for with
  `stream_options.include_usage`), never a count of chunks.

A request is an error when the status is not 200, a frame is not JSON or carries an `error`,
the stream ends without `data: [DONE]` or without usage, or the connection fails. Errors are
counted and reported, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestResult:
    """What one request measured; filled in as its stream arrives."""

    index: int  # position in the workload's prompt list
    sent_s: float = 0.0  # seconds after the phase started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    dropped: bool = False  # cancelled by the client (autocomplete) before it finished

    @property
    def is_ok(self) -> bool:
        return self.error is None and not self.dropped and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.is_ok or not self.output_tokens or self.output_tokens < 2:
            return None
        assert self.e2e_s is not None and self.ttft_s is not None  # is_ok: both were measured
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        record = asdict(self)
        record["tpot_s"] = self.tpot_s
        return record


PhaseResults = dict[str, tuple[list[RequestResult], float]]  # phase label -> (results, wall s)


def completion_body(
    model: str, prompt: str, max_tokens: int, ignore_eos: bool = False, temperature: float = 0.0
) -> dict[str, object]:
    """The request every arm gets: greedy unless a temperature is given, streamed, with usage
    in the last chunk."""
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; nanoserve and the hf baseline take it too
    return body


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, result: RequestResult, t0: float
) -> None:
    """Send one streamed completion and record its timings into `result`.

    Cancelling the task closes the connection (how autocomplete clients drop a request); the
    caller then marks `result.dropped`.
    """
    start = time.perf_counter()
    result.sent_s = start - t0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return
            saw_done, usage = await _read_events(response, result, start)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    end = time.perf_counter()
    if result.error is not None:
        return  # a bad frame, already recorded
    if not saw_done:
        result.error = "stream ended without data: [DONE]"
    elif usage is None:
        result.error = "no usage in the stream (stream_options.include_usage was asked for)"
    elif result.ttft_s is None:
        result.error = "no chunk with choices before [DONE]"
    else:
        result.e2e_s = end - start
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")


async def _read_events(
    response: httpx.Response, result: RequestResult, start: float
) -> tuple[bool, dict | None]:
    """Read the SSE stream into `result`: (whether `data: [DONE]` came, the last usage seen).

    Stops at the first frame that is not JSON or carries an error, with `result.error` set.
    """
    event = None
    last_chunk: float | None = None
    usage = None
    async for line in response.aiter_lines():
        now = time.perf_counter()
        if not line:
            event = None  # a blank line ends an SSE event
            continue
        if line.startswith(":"):
            continue  # SSE comment / keep-alive
        if line.startswith("event:"):
            event = line[len("event:") :].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return True, usage
        try:
            frame = json.loads(data)
        except ValueError:
            result.error = f"frame is not JSON: {data[:200]!r}"
            return False, usage
        if event == "error" or (isinstance(frame, dict) and frame.get("error")):
            result.error = f"error frame: {json.dumps(frame)[:300]}"
            return False, usage
        last_chunk = _record_chunk(frame.get("choices") or [], result, now - start, now, last_chunk)
        if frame.get("usage"):
            usage = frame["usage"]
    return False, usage


def _record_chunk(
    choices: list[dict], result: RequestResult, since_start_s: float, now: float, last: float | None
) -> float | None:
    """TTFT at the first chunk with choices, an ITL gap per chunk with text; the new `last`."""
    if not choices:
        return last
    if result.ttft_s is None:
        result.ttft_s = since_start_s
    text = "".join(choice.get("text") or "" for choice in choices)
    if text:
        if last is not None:
            result.itl_s.append(now - last)
        last = now
        result.text += text
    for choice in choices:
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    return last


class Progress:
    """Prints `done/total` for a long phase every few seconds (and once at the end)."""

    def __init__(self, label: str, total: int, interval_s: float = 5.0) -> None:
        self.label, self.total, self.interval_s = label, total, interval_s
        self.done = self.errors = 0
        self.started = time.perf_counter()
        self._last_print = self.started
        self._last_done = -1

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += result.error is not None
        now = time.perf_counter()
        if now - self._last_print >= self.interval_s:
            self._last_print = now
            self._print()

    def finish(self) -> None:
        if self._last_done != self.done:
            self._print()

    def _print(self) -> None:
        self._last_done = self.done
        elapsed = time.perf_counter() - self.started
        print(
            f"  {self.label}: {self.done}/{self.total} requests, {self.errors} errors, "
            f"{elapsed:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def is_interrupt(exception: BaseException | None) -> bool:
    """A KeyboardInterrupt (Ctrl-C, or a signal the runner turns into one), or a group of
    nothing but interrupts and cancellations: httpx's connection code (anyio) wraps what lands
    inside its task groups."""
    if isinstance(exception, KeyboardInterrupt):
        return True
    inner: tuple[BaseException, ...] = getattr(exception, "exceptions", ())  # a group's members
    return bool(inner) and all(
        is_interrupt(e) or isinstance(e, asyncio.CancelledError) for e in inner
    )


def quiet_about_interrupts(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The measuring loops' exception handler: a request task that an interrupt ended is not
    logged (asyncio would print its traceback as `asyncio.run` shuts down, around the one line
    the bench prints when interrupted); anything else is, as by default."""
    if not is_interrupt(context.get("exception")):
        loop.default_exception_handler(context)


def make_client(timeout_s: float) -> httpx.AsyncClient:
    """One client per phase; no connection limit so `max_concurrency` alone sets the load."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def run_phase(
    url: str,
    bodies: list[dict],
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    timeout_s: float,
    label: str,
) -> tuple[list[RequestResult], float]:
    """Send `bodies` with Poisson arrivals at `request_rate` (inf: all at once), at most
    `max_concurrency` in flight. Returns the results in `bodies` order and the wall time from
    the first send to the last completion."""
    asyncio.get_running_loop().set_exception_handler(quiet_about_interrupts)
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency or len(bodies) or 1)
    results = [RequestResult(index=i) for i in range(len(bodies))]
    progress = Progress(label, len(bodies))

    async def one(client: httpx.AsyncClient, i: int) -> None:
        async with semaphore:
            await stream_completion(client, url, bodies[i], results[i], t0)
        progress.update(results[i])

    async with make_client(timeout_s) as client:
        t0 = time.perf_counter()
        tasks = []
        for i in range(len(bodies)):
            tasks.append(asyncio.create_task(one(client, i)))
            if not math.isinf(request_rate) and i + 1 < len(bodies):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - t0
    progress.finish()
    return results, duration_s


async def run_typing(
    url: str,
    bodies_and_times: list[tuple[dict, float]],
    timeout_s: float,
    label: str,
) -> tuple[list[RequestResult], float]:
    """Autocomplete: send each body at its time (seconds after start); a new request drops the
    previous one if it is still running, by cancelling it (the connection is closed)."""
    asyncio.get_running_loop().set_exception_handler(quiet_about_interrupts)
    results = [RequestResult(index=i) for i in range(len(bodies_and_times))]
    progress = Progress(label, len(bodies_and_times))
    previous: tuple[asyncio.Task, RequestResult] | None = None
    async with make_client(timeout_s) as client:
        t0 = time.perf_counter()
        for i, (body, at_s) in enumerate(bodies_and_times):
            delay = at_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if previous is not None:
                await _drop_if_running(*previous, progress)
            task = asyncio.create_task(stream_completion(client, url, body, results[i], t0))
            previous = (task, results[i])
        if previous is not None:
            await previous[0]
            progress.update(previous[1])
    duration_s = time.perf_counter() - t0
    progress.finish()
    return results, duration_s


async def _drop_if_running(task: asyncio.Task, result: RequestResult, progress: Progress) -> None:
    if not task.done():
        task.cancel()
        result.dropped = True
    try:
        await task
    except asyncio.CancelledError:
        if not result.dropped:
            raise
    progress.update(result)
