"""The shared run and stream machinery of every generation endpoint.

A `RequestRun` is one API request's engine requests, from fan-out to the last delta: it hands
the engine client one request per choice, feeds each delta that arrives through the shared
`OutputProcessor` (text, stop strings, logprobs, finish reasons), aborts a choice that a stop
string ended, and records the request's metrics. `sse_stream` frames any endpoint's chunks as
server-sent events.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from nanoserve.client.engine_client import (
    EngineClient,
    EngineDeadError,
    RequestRejectedError,
    RequestStream,
)
from nanoserve.common.protocol import RequestDelta
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.server.errors import APIError, error_body
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.openai.api_models import UsageInfo
from nanoserve.text.output_processor import ChoiceState, ChoiceUpdate, OutputProcessor

SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class NamedEvent:
    """An event with an `event:` name (the Responses API's typed events)."""

    name: str
    data: dict[str, Any]


def sse_frame(payload: BaseModel | dict[str, Any] | NamedEvent) -> str:
    """One server-sent event: [`event: <name>`,] `data: <json>` and the blank line ending it."""
    if isinstance(payload, NamedEvent):
        return f"event: {payload.name}\ndata: {json.dumps(payload.data)}\n\n"
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel | NamedEvent]) -> AsyncIterator[str]:
    """Frame `chunks` as SSE; an error after the 200 headers becomes an error frame; then DONE."""
    try:
        async for chunk in chunks:
            yield sse_frame(chunk)
    except APIError as e:
        yield sse_frame(e.body())
    except EngineDeadError as e:
        yield sse_frame(error_body(str(e), 503))
    except RequestRejectedError as e:
        yield sse_frame(error_body(str(e), 400))
    yield SSE_DONE


class RequestRun:
    """The engine requests of one API request, from fan-out to the last delta.

    `close()` aborts whatever has not finished; the handler calls it however it ends
    (done, error, client gone).
    """

    def __init__(
        self, client: EngineClient, metrics: ServerMetrics, processor: OutputProcessor
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.processor = processor
        self.stream = RequestStream()
        self.arrival_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.is_complete = False
        self._last_token_time: dict[str, float] = {}

    def add_prompt(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, index: int
    ) -> None:
        """Send the engine one request per choice of prompt `index`."""
        for request in self.processor.add_request(request_id, prompt_token_ids, params, index):
            self.client.add_request(
                request.request_id, request.prompt_token_ids, request.params, self.stream
            )
        self.num_prompt_tokens += len(prompt_token_ids)
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))

    @property
    def choices(self) -> list[ChoiceState]:
        """Every choice, in response order."""
        return self.processor.sorted_choices()

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Per burst of deltas, what they added to their choices, until every choice ended."""
        while self.processor.num_unfinished:
            deltas = [await self.stream.get()]
            while (delta := self.stream.get_nowait()) is not None:
                deltas.append(delta)
            updates = [u for u in map(self._apply, deltas) if u is not None]
            if updates:
                yield updates
        self.is_complete = True

    def _apply(self, delta: RequestDelta) -> ChoiceUpdate | None:
        update = self.processor.process(delta)
        if update is None:
            return None  # its choice ended at a stop string; the abort crossed this delta
        if update.needs_abort:  # a stop string ended the text; the engine does not know it
            self.client.abort([delta.request_id])
        self._observe(update, delta.queue_time_s)
        return update

    def _observe(self, update: ChoiceUpdate, queue_time_s: float | None) -> None:
        """TTFT, inter-token latency, token counts and, at the end, the request's latency."""
        now = time.monotonic()
        request_id = update.choice.request_id
        num_new = len(update.token_ids)
        if num_new:
            last = self._last_token_time.get(request_id)
            if last is None:
                self.metrics.time_to_first_token.observe(now - self.arrival_time)
            else:
                for _ in range(num_new):
                    self.metrics.inter_token_latency.observe((now - last) / num_new)
            self._last_token_time[request_id] = now
            self.metrics.generation_tokens.inc(num_new)
        if queue_time_s is not None:
            self.metrics.request_queue_time.observe(queue_time_s)
        if update.choice.finish_reason is not None:
            self.metrics.observe_finished(update.choice.finish_reason)
            self.metrics.e2e_request_latency.observe(now - self.arrival_time)

    def usage(self) -> UsageInfo:
        num_completion = sum(len(c.token_ids) for c in self.processor.choices.values())
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_completion,
            total_tokens=self.num_prompt_tokens + num_completion,
        )

    def close(self) -> bool:
        """Abort unfinished choices; True if the request ended early (client gone, error)."""
        unfinished = self.processor.unfinished_request_ids()
        if unfinished:
            self.client.abort(unfinished)
        return not self.is_complete
