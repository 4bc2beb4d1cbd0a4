"""StepRecorder: what each engine step did of the requests that record a timeline.

A request asks with `AddRequest.record_timeline`. After each step the loop hands the recorder
the engine's schedule; for those requests it writes a `StepRecord`: which tokens each ran (a
prompt chunk, a recompute after preemption, or decode tokens: a count, never assumed to be 1),
how big the step's batch was, and which were preempted. Steps that ran none of them cost one
set lookup per scheduled request; with no request recording, nothing at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from nanoserve.common.protocol import RequestDelta, ScheduledChunk, StepRecord


class ScheduledRequest(Protocol):
    """What the recorder reads of a scheduled request (`core.request.Request` is one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...


class Schedule(Protocol):
    """What the recorder reads of a step's schedule (`core.scheduler.SchedulerOutput`)."""

    @property
    def num_scheduled_tokens(self) -> dict[str, int]: ...

    @property
    def requests(self) -> Sequence[ScheduledRequest]: ...

    @property
    def preempted_ids(self) -> list[str]: ...


class StepRecorder:
    """The ids of the requests that record a timeline, and each step's record of them."""

    def __init__(self) -> None:
        self.recorded_ids: set[str] = set()
        self.num_steps = 0

    def add(self, request_id: str) -> None:
        self.recorded_ids.add(request_id)

    def discard(self, request_ids: list[str]) -> None:
        self.recorded_ids.difference_update(request_ids)

    def record(
        self,
        schedule: Schedule | None,  # None: no request records a timeline
        start_time: float,
        end_time: float,
        deltas: list[RequestDelta],
    ) -> StepRecord | None:
        """This step's record, or None if it ran none of the recorded requests.

        Read after the step: a request's `num_computed_tokens` already counts what it ran.
        """
        self.num_steps += 1
        if schedule is None:
            return None
        counts = schedule.num_scheduled_tokens
        chunks = []
        for request in schedule.requests:
            if request.request_id in self.recorded_ids:
                num_tokens = counts[request.request_id]
                num_computed = request.num_computed_tokens - num_tokens  # before the step
                chunks.append(ScheduledChunk(request.request_id, num_computed, num_tokens))
        preempted = [i for i in schedule.preempted_ids if i in self.recorded_ids]
        self.discard([d.request_id for d in deltas if d.finish_reason is not None])
        if not chunks and not preempted:
            return None
        return StepRecord(
            step_index=self.num_steps,
            start_time=start_time,
            end_time=end_time,
            num_requests=len(counts),
            num_batched_tokens=sum(counts.values()),
            chunks=chunks,
            preempted_ids=preempted,
        )
