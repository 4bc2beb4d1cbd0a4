"""The engine loop: drain incoming messages → step → send outputs, until told to stop.

Torch-free and written against any receive/send pair, so that the same loop runs in the worker
process (ZMQ sockets), on a thread of the front (`client/inprocess.py`, a queue and the event
loop) and in tests (lists).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import (
    AbortRequests,
    AddRequest,
    EngineStats,
    Ready,
    RequestDelta,
    RequestFailed,
    Shutdown,
    StepOutputs,
)
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.worker.inbox import Inbox
from nanoserve.worker.step_records import Schedule, StepRecorder

IDLE_POLL_S = 0.5  # how long an idle loop blocks on its inbox before checking `should_exit`


class ServedEngine(Protocol):
    """What the loop needs of an engine (`nanoserve.core.engine.Engine` is one)."""

    config: EngineConfig
    max_model_len: int
    vocab_size: int
    load_time_s: float  # reading the weights
    prepare_time_s: float  # installing linear methods and layer ops
    kv_sizing_time_s: float  # sizing and allocating the KV pool, building the step runners

    @property
    def last_schedule(self) -> Schedule | None:
        """What the last step ran (read only for requests that record a timeline)."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def step(
        self, are_aborted: Callable[[list[str]], bool] | None = None
    ) -> list[RequestDelta]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def warm_up(self) -> None: ...

    def idle_work(self) -> bool:
        """A short slice of background work while nothing runs; True while more remains."""


def serve_engine(
    engine: ServedEngine,
    recv: Callable[[float], object],
    send: Callable[[msgspec.Struct], None],
    should_exit: Callable[[], bool] = lambda: False,
) -> None:
    """The loop. Blocks on `recv` only when the engine has nothing to run.

    `recv(timeout_s)` returns the next ToWorker message or None (0: do not wait). After a batch
    of messages changed something (a new request, an abort) the engine's stats are sent even
    when no step runs, so the front sees freed KV blocks at once. A step that ran a request
    recording its timeline carries its `StepRecord`. While nothing runs, the engine's idle
    work goes on a slice at a time, the inbox checked between slices. A running step may look
    at the inbox too, and stop once all its requests were aborted (`inbox.py`).
    """
    recorder = StepRecorder()
    inbox = Inbox(recv)
    has_idle_work = True
    while not should_exit():
        is_idle = not engine.has_unfinished_requests()
        is_changed = False
        while True:
            is_waiting = is_idle and not is_changed
            message = inbox.next(IDLE_POLL_S if is_waiting and not has_idle_work else 0)
            if message is None:
                if is_waiting and not should_exit():
                    has_idle_work = has_idle_work and engine.idle_work()
                    continue  # nothing to do: keep waiting
                break
            if isinstance(message, Shutdown):
                return
            _handle(engine, message, send, recorder)
            is_changed = True
        if engine.has_unfinished_requests():
            started = time.monotonic()
            deltas = engine.step(inbox.are_aborted)
            schedule = engine.last_schedule if recorder.recorded_ids else None
            step = recorder.record(schedule, started, time.monotonic(), deltas)
            send(StepOutputs(deltas=deltas, stats=engine.stats(), step=step))
        elif is_changed:
            send(StepOutputs(deltas=[], stats=engine.stats()))


def _handle(
    engine: ServedEngine,
    message: object,
    send: Callable[[msgspec.Struct], None],
    recorder: StepRecorder,
) -> None:
    if isinstance(message, AddRequest):
        try:
            engine.add_request(
                message.request_id, message.prompt_token_ids, message.params, message.arrival_time
            )
        except ValueError as e:  # the engine refused this request; the loop goes on
            send(RequestFailed(request_id=message.request_id, message=str(e)))
            return
        if message.record_timeline:
            recorder.add(message.request_id)
    elif isinstance(message, AbortRequests):
        engine.abort(message.request_ids)
        recorder.discard(message.request_ids)
    else:
        raise TypeError(f"unexpected message for the engine loop: {type(message).__name__}")


def ready_message(
    engine: ServedEngine,
    warmup_time_s: float,
    imports_time_s: float = 0.0,
    setup_time_s: float = 0.0,
) -> Ready:
    """What the front learns once the engine is loaded and warmed up (a worker process also
    says how long its imports and its fast paths took)."""
    stats = engine.stats()
    return Ready(
        pid=os.getpid(),
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        num_kv_blocks=stats.num_kv_blocks,
        block_size=stats.block_size,
        load_time_s=engine.load_time_s,
        kv_sizing_time_s=engine.kv_sizing_time_s,
        warmup_time_s=warmup_time_s,
        prepare_time_s=engine.prepare_time_s,
        imports_time_s=imports_time_s,
        setup_time_s=setup_time_s,
        kv_cache_dtype=engine.config.kv_cache_dtype,
    )
