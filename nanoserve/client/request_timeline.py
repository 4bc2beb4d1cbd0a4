"""RequestTimelines: what the engine did with each recent request, step by step, for learners.

The worker describes each step that ran a recording request (`StepRecord`: the tokens it ran,
the batch around it, preemptions); this module turns those into one timeline per engine
request, filed under its API request's id:

    arrived     the HTTP request came in                  queued      sent to the engine
    admitted    first scheduled; `cached_tokens`: its prefix-cache hit (again after a preemption)
    prefill     a prompt chunk: tokens [first_position, + num_tokens), with the step's batch
    decode      consecutive decode steps at one batch size, merged into one event
    recompute   tokens it had before a preemption, run again
    preempted   its KV blocks were taken for an older request; it waits to be readmitted
    finished    stop, length, abort (the client left, or a stop string), or error

Bounded: the last `max_requests` API requests are kept, each engine request's events are cut at
`max_events` (`num_events_dropped` says how many went), and no prompt or output text is kept.
Times are seconds since the request arrived (`time.monotonic()`, which the worker shares on one
machine).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nanoserve.common.protocol import ScheduledChunk, StepRecord

DEFAULT_MAX_REQUESTS = 100
DEFAULT_MAX_EVENTS = 2048
TERMINAL_EVENTS = ("preempted", "finished")  # kept past the cut: they say how it ended


@dataclass
class EngineRequestTimeline:
    """One engine request's events (one choice of an API request)."""

    request_id: str
    num_prompt_tokens: int
    arrival_time: float
    events: list[dict[str, Any]] = field(default_factory=list)
    num_events_dropped: int = 0
    num_output_tokens: int = 0  # decode tokens run
    num_positions_run: int = 0  # the furthest position it has had in the KV cache
    is_waiting: bool = True  # not admitted yet, or preempted and not readmitted
    num_preemptions: int = 0
    is_finished: bool = False

    def add(self, event: dict[str, Any], max_events: int) -> None:
        if len(self.events) >= max_events and event["type"] not in TERMINAL_EVENTS:
            self.num_events_dropped += 1
            return
        self.events.append(event)

    def since_arrival(self, t: float) -> float:
        return round(t - self.arrival_time, 6)

    def as_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_preemptions": self.num_preemptions,
            "num_events_dropped": self.num_events_dropped,
            "events": self.events,
        }


class RequestTimelines:
    """The timelines of the last `max_requests` API requests that asked for one."""

    def __init__(
        self, max_requests: int = DEFAULT_MAX_REQUESTS, max_events: int = DEFAULT_MAX_EVENTS
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be ≥ 1, got {max_requests}")
        if max_events < 4:
            raise ValueError(f"max_events must be ≥ 4, got {max_events}")
        self.max_requests = max_requests
        self.max_events = max_events
        self._groups: OrderedDict[str, list[EngineRequestTimeline]] = OrderedDict()
        self._live: dict[str, EngineRequestTimeline] = {}  # engine request id -> unfinished

    def add(
        self,
        api_request_id: str,
        engine_request_id: str,
        num_prompt_tokens: int,
        arrival_time: float,
        queued_time: float,
    ) -> None:
        """Start recording one engine request of `api_request_id` (the oldest API request
        goes when more than `max_requests` are kept)."""
        timeline = EngineRequestTimeline(engine_request_id, num_prompt_tokens, arrival_time)
        timeline.add({"type": "arrived", "t": 0.0}, self.max_events)
        timeline.add({"type": "queued", "t": timeline.since_arrival(queued_time)}, self.max_events)
        group = self._groups.setdefault(api_request_id, [])
        self._groups.move_to_end(api_request_id)
        group.append(timeline)
        self._live[engine_request_id] = timeline
        while len(self._groups) > self.max_requests:
            _, evicted = self._groups.popitem(last=False)
            for old in evicted:
                self._live.pop(old.request_id, None)

    def is_recording(self, engine_request_id: str) -> bool:
        return engine_request_id in self._live

    def on_step(self, step: StepRecord) -> None:
        """What one step ran of the recorded requests, then whom it preempted."""
        for chunk in step.chunks:
            timeline = self._live.get(chunk.request_id)
            if timeline is not None:
                self._on_chunk(timeline, chunk, step)
        for request_id in step.preempted_ids:
            timeline = self._live.get(request_id)
            if timeline is not None:
                timeline.is_waiting = True
                timeline.num_preemptions += 1
                event = {"type": "preempted", "t": timeline.since_arrival(step.end_time)}
                timeline.add(event, self.max_events)

    def _on_chunk(
        self, timeline: EngineRequestTimeline, chunk: ScheduledChunk, step: StepRecord
    ) -> None:
        start = chunk.num_computed_tokens
        end = start + chunk.num_tokens
        if timeline.is_waiting:  # admitted in this step: what it started from was cached
            timeline.is_waiting = False
            event = {"type": "admitted", "t": timeline.since_arrival(step.start_time)}
            timeline.add({**event, "cached_tokens": start}, self.max_events)
        if start >= timeline.num_positions_run and start >= timeline.num_prompt_tokens:
            kind = "decode"
            timeline.num_output_tokens += chunk.num_tokens
        elif timeline.num_preemptions:
            kind = "recompute"
        else:
            kind = "prefill"
        timeline.num_positions_run = max(timeline.num_positions_run, end)
        if kind == "decode" and self._extends_decode(timeline, step):
            last = timeline.events[-1]
            last.update(end=timeline.since_arrival(step.end_time), last_step=step.step_index)
            last["num_steps"] += 1
            last["num_tokens"] += chunk.num_tokens
            return
        event = {
            "type": kind,
            "start": timeline.since_arrival(step.start_time),
            "end": timeline.since_arrival(step.end_time),
            "first_step": step.step_index,
            "last_step": step.step_index,
            "num_steps": 1,
            "first_position": start,
            "num_tokens": chunk.num_tokens,
            "batch_size": step.num_requests,
            "batch_tokens": step.num_batched_tokens,
        }
        timeline.add(event, self.max_events)

    @staticmethod
    def _extends_decode(timeline: EngineRequestTimeline, step: StepRecord) -> bool:
        """The last event is a decode run that this step continues at the same batch size."""
        if not timeline.events:
            return False
        last = timeline.events[-1]
        return (
            last["type"] == "decode"
            and last["last_step"] == step.step_index - 1
            and last["batch_size"] == step.num_requests
        )

    def on_finished(self, engine_request_id: str, reason: str, t: float) -> None:
        """The engine request ended (the last delta, an abort, an error)."""
        timeline = self._live.pop(engine_request_id, None)
        if timeline is not None:
            timeline.is_finished = True
            event = {"type": "finished", "t": timeline.since_arrival(t), "reason": reason}
            timeline.add(event, self.max_events)

    def get(self, api_request_id: str) -> list[EngineRequestTimeline] | None:
        return self._groups.get(api_request_id)

    def as_json(self, api_request_id: str) -> dict[str, Any] | None:
        """The timeline of an API request, or None if it is not kept."""
        group = self._groups.get(api_request_id)
        if group is None:
            return None
        return {
            "id": api_request_id,
            "object": "request.timeline",
            "is_finished": all(t.is_finished for t in group),
            "requests": [t.as_json() for t in group],
        }
