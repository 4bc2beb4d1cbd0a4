"""RequestRun: one API request's engine requests, from fan-out to its answer over HTTP.

`start_run` checks the room the request needs, sends the engine one request per choice of
every prompt, and, for a constrained request, waits for the engine's first event: a grammar
the worker could not compile comes back as that event, and is answered with a 400 before any
header goes out. The run feeds each delta through the `OutputProcessor` (text, stop strings,
logprobs, finish reasons), aborts a choice that a stop string ended, and records the request's
metrics. `stream_answer` and `whole_answer` send it as SSE or as one JSON body; however the
answer ends (done, error, client gone), the run is closed and its unfinished choices aborted.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from nanoserve.client.engine_client import EngineClient, RequestStream
from nanoserve.common.protocol import RequestDelta
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.server.errors import ENGINE_ERRORS, ClientDisconnected, engine_error
from nanoserve.server.metrics import RequestTimes, ServerMetrics
from nanoserve.server.openai.api_models import StreamOptions, UsageInfo
from nanoserve.server.openai.checks import check_capacity, check_logprobs_size
from nanoserve.server.openai.constraints import Constraint
from nanoserve.server.openai.served_model import ServedModel
from nanoserve.server.request_timeline import wants_timeline
from nanoserve.server.sse import EventStreamResponse, NamedEvent, sse_stream
from nanoserve.text.output_processor import ChoiceState, ChoiceUpdate, OutputProcessor

R = TypeVar("R")


async def start_run(
    model: ServedModel,
    request: Request,
    prompts: list[list[int]],
    params: list[SamplingParams],
    id_prefix: str,
    constraint: Constraint | None,
) -> RequestRun:
    """Check room for every choice of every prompt, add them; a constrained run also waits for
    its first event (a 400 naming `constraint.param` if its grammar did not compile)."""
    check_logprobs_size(prompts, params)
    num_choices = [p.n for p in params]
    # Again, after the prompts were tokenized: the queue may have filled meanwhile.
    check_capacity(model, sum(num_choices), "n" if max(num_choices) > 1 else "prompt")
    processor = OutputProcessor(model.tokenizer, model.token_text)
    run = RequestRun(model.client, model.metrics, processor, f"{id_prefix}-{uuid.uuid4().hex}")
    run.records_timeline = wants_timeline(model.config, request.headers)
    try:
        for index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            run.add_prompt(prompt, prompt_params, index)
        if constraint is not None:
            await wait_unless_disconnected(request, run.wait_for_first_delta())
    except ENGINE_ERRORS as e:
        run.close()
        raise engine_error(e, constraint.param if constraint is not None else None) from None
    except BaseException:  # a client gone (the app answers 499 and counts it), a cancel
        run.close()
        raise
    return run


class RequestRun:
    """The engine requests of one API request, from fan-out to the last delta.

    `close()` aborts whatever has not finished; the answer calls it however it ends.
    """

    def __init__(
        self,
        client: EngineClient,
        metrics: ServerMetrics,
        processor: OutputProcessor,
        request_id: str,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.processor = processor
        self.request_id = request_id  # the answer's id; choice i is engine request `<id>-i`
        self.stream = RequestStream()
        self.arrival_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.is_complete = False
        self._is_closed = False
        self._first: RequestDelta | None = None  # taken by `wait_for_first_delta`, not applied
        self._times: dict[str, RequestTimes] = {}  # engine request id -> what metrics need
        self.records_timeline = False  # its engine requests record their timelines

    def add_prompt(self, prompt_token_ids: list[int], params: SamplingParams, index: int) -> None:
        """Send the engine one request per choice of prompt `index`."""
        requests = self.processor.add_request(self.request_id, prompt_token_ids, params, index)
        timelines = self.client.timelines if self.records_timeline else None
        for request in requests:
            if timelines is not None:
                timelines.add(
                    self.request_id,
                    request.request_id,
                    len(prompt_token_ids),
                    self.arrival_time,
                    time.monotonic(),
                )
            try:
                engine = self.client.add_request(
                    request.request_id,
                    request.prompt_token_ids,
                    request.params,
                    self.stream,
                    record_timeline=timelines is not None,
                )
            except ENGINE_ERRORS:
                if timelines is not None:
                    timelines.on_finished(request.request_id, "error", time.monotonic())
                raise
            self._times[request.request_id] = RequestTimes(
                engine, len(prompt_token_ids), params.n, params.max_tokens, self.arrival_time
            )
        self.num_prompt_tokens += len(prompt_token_ids)

    async def wait_for_first_delta(self) -> None:
        """Wait until the engine has answered: its first delta, or the error that ends the run."""
        self._first = await self.stream.get()

    @property
    def choices(self) -> list[ChoiceState]:
        """Every choice, in response order."""
        return self.processor.sorted_choices()

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Per burst of deltas, what they added to their choices, until every choice ended."""
        while self.processor.num_unfinished:
            deltas = await self._next_burst()
            updates = [u for u in map(self._apply, deltas) if u is not None]
            if updates:
                yield updates
        self.is_complete = True

    async def _next_burst(self) -> list[RequestDelta]:
        """The deltas at hand, at most one per engine request (the stream merges the rest)."""
        if self._first is not None:  # a burst of its own: the stream may hold a later delta of
            first, self._first = self._first, None  # the same request, unmerged with this one
            return [first]
        deltas = [await self.stream.get()]
        while (delta := self.stream.get_nowait()) is not None:
            deltas.append(delta)
        return deltas

    async def finish(self) -> None:
        """Run to the end (for a whole answer: its choices hold everything)."""
        async for _ in self.updates():
            pass

    def _apply(self, delta: RequestDelta) -> ChoiceUpdate | None:
        update = self.processor.process(delta)
        if update is None:
            return None  # its choice ended at a stop string; the abort crossed this delta
        if update.needs_abort:  # a stop string ended the text; the engine does not know it
            if self.client.timelines is not None:  # its timeline ends as its answer does
                self.client.timelines.on_finished(delta.request_id, "stop", time.monotonic())
            self.client.abort([delta.request_id])
        self._observe(update, delta)
        return update

    def _observe(self, update: ChoiceUpdate, delta: RequestDelta) -> None:
        """Token counts and times of the delta's request and, at its end, its outcome."""
        now = time.monotonic()
        times = self._times[delta.request_id]
        self.metrics.observe_delta(
            times, len(update.token_ids), now, delta.queue_time_s, delta.num_cached_tokens
        )
        if update.choice.finish_reason is not None:
            self.metrics.observe_finished(times, update.choice.finish_reason, now)

    def usage(self) -> UsageInfo:
        num_completion = sum(len(c.token_ids) for c in self.processor.choices.values())
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_completion,
            total_tokens=self.num_prompt_tokens + num_completion,
        )

    def close(self, client_went_away: bool = False) -> None:
        """Abort unfinished choices (their KV blocks are freed; each counts as finished for
        `abort`, as vLLM counts them); count a client that left. Only the first call acts."""
        if self._is_closed:
            return
        self._is_closed = True
        unfinished = self.processor.unfinished_request_ids()
        if unfinished:
            self.client.abort(unfinished)
        now = time.monotonic()
        for request_id in unfinished:
            if (times := self._times.get(request_id)) is not None:  # it reached an engine
                self.metrics.observe_finished(times, "abort", now)
        if client_went_away:
            self.metrics.http_requests_client_disconnected.inc()


def stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk): vLLM's `stream_options`, where
    `continuous_usage_stats` counts only with `include_usage`."""
    if options is None:
        return False, False
    return options.include_usage, options.include_usage and options.continuous_usage_stats


def stream_answer(run: RequestRun, chunks: AsyncIterator[BaseModel | NamedEvent]) -> Response:
    """`chunks` as server-sent events; the run is closed when the stream ends, however."""
    return EventStreamResponse(
        sse_stream(chunks), on_close=lambda is_complete: run.close(not is_complete)
    )


async def whole_answer(
    request: Request, run: RequestRun, body: Awaitable[BaseModel | dict[str, Any]]
) -> Response:
    """`body` (built once the run is done) as one JSON response; the run is closed after."""
    client_went_away = False
    try:
        answer = await wait_unless_disconnected(request, body)
    except ClientDisconnected:
        client_went_away = True
        return Response(status_code=499)  # nobody is listening any more
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    finally:
        run.close(client_went_away)
    text = answer.model_dump_json() if isinstance(answer, BaseModel) else json.dumps(answer)
    return Response(text, media_type="application/json")


async def wait_unless_disconnected(request: Request, work: Awaitable[R]) -> R:
    """Await `work`, but raise ClientDisconnected as soon as the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientDisconnected


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
