"""EngineClient: how the front talks to an engine, whichever way the messages travel.

`EngineClient` routes each step's deltas to per-request `RequestStream`s on the event loop and
keeps the engine's readiness, stats and in-flight requests. Its subclasses move the messages:

    ZmqEngineClient        zmq_engine_client.py   a worker process over ZMQ (the server); it
                                                  watches the worker and restarts it
    InProcessEngineClient  inprocess.py           an engine on a thread of this process (tests)
    DataParallelClient     data_parallel.py       several ZmqEngineClients behind one router
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from nanoserve.client.request_stream import RequestStream
from nanoserve.client.request_timeline import RequestTimelines
from nanoserve.common.protocol import (
    AbortRequests,
    AddRequest,
    EngineStats,
    Ready,
    RequestDelta,
    RequestFailed,
    StepOutputs,
)
from nanoserve.common.sampling_params import SamplingParams

logger = logging.getLogger("nanoserve.server")


class EngineDeadError(RuntimeError):
    """The engine died or is not ready: the request cannot be (or finish being) served."""


class EngineStartError(RuntimeError):
    """The engine failed before it became ready; `is_config_error`: a bad setting, not a bug."""

    def __init__(self, message: str, is_config_error: bool = False) -> None:
        super().__init__(message)
        self.is_config_error = is_config_error


class RequestRejectedError(ValueError):
    """The engine refused one request (the front's validation should have caught it)."""


class EngineClient:
    """Routes engine outputs to request streams. Subclasses move the messages."""

    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index  # which data-parallel engine (0 without data parallel)
        self.info: Ready | None = None  # set once the engine is ready; kept while restarting
        self.stats = EngineStats()
        # Called with each step's stats and this engine's index (the metrics' `engine` label).
        self.on_stats: Callable[[EngineStats, int], None] | None = None
        self.on_ready: Callable[[Ready], None] | None = None  # each time an engine is ready
        # Called with the tokens of each engine step that produced any, and the engine's index:
        # those generated, and the prompts whose prefill the step ended (vLLM's count).
        self.on_step_tokens: Callable[[int, int], None] | None = None
        # Where the timelines of requests added with `record_timeline` go (None: not kept).
        self.timelines: RequestTimelines | None = None
        self._is_ready = False
        self._is_accepting = True  # False once the server is shutting down
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its stream
        # Added, no token yet (waiting or in prefill): engine request id -> its prompt's length.
        self._unstarted: dict[str, int] = {}
        self._shutdown_timer: asyncio.TimerHandle | None = None
        self.start_error: EngineStartError | None = None  # why the first engine never got ready
        # Called once if the first engine fails before it is ready (the server then stops).
        self.on_start_failed: Callable[[EngineStartError], None] | None = None

    @property
    def is_ready(self) -> bool:
        """The engine is serving and the server takes new requests."""
        return self._is_ready and self._is_accepting

    @property
    def is_accepting(self) -> bool:
        return self._is_accepting

    @property
    def num_unstarted(self) -> int:
        return len(self._unstarted)

    @property
    def num_engines(self) -> int:
        """Engines behind this client (each reports its own stats)."""
        return 1

    @property
    def num_in_flight(self) -> int:
        """Engine requests added and not yet finished or aborted (the router's load)."""
        return len(self._streams)

    def launch(self) -> None:
        """Start the engine's processes early, before the event loop runs, where there are
        any (a worker's imports then overlap the front's); `start` still must be awaited."""

    async def start(self) -> None:
        """Start the engine in the background and return; `is_ready` says when it serves."""
        raise NotImplementedError

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine (waiting at most `timeout_s`) and release all it held."""
        raise NotImplementedError

    def kill_now(self) -> None:
        """Last resort (atexit, after a forced exit): end the engine without waiting."""
        raise NotImplementedError

    def _send(self, message: msgspec.Struct) -> bool:
        raise NotImplementedError

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: RequestStream,
        record_timeline: bool = False,
    ) -> int:
        """Queue one (n == 1) engine request; its deltas will arrive on `stream`. Returns the
        index of the engine that runs it. `record_timeline`: the worker describes its steps
        (for `self.timelines`, where the caller has started its timeline)."""
        if not self._is_ready:
            raise EngineDeadError("the model worker is not ready")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = stream
        self._unstarted[request_id] = len(prompt_token_ids)
        message = AddRequest(
            request_id, list(prompt_token_ids), params, time.monotonic(), record_timeline
        )
        if not self._send(message):
            self._remove(request_id)
            raise EngineDeadError("the model worker is not reachable")
        return self.engine_index

    def begin_shutdown(self, grace_s: float) -> None:
        """Take no new requests; those in flight get `grace_s` seconds to finish, then end.

        At the deadline every unfinished stream gets EngineDeadError ("the server is shutting
        down": an error frame and `data: [DONE]` for a stream, a 503 otherwise) and the worker
        aborts the requests, so that the HTTP server's grace period ends with complete answers.
        """
        self._is_accepting = False
        self._shutdown_timer = asyncio.get_running_loop().call_later(
            grace_s, self._end_in_flight, "the server is shutting down"
        )

    def _end_in_flight(self, reason: str) -> None:
        request_ids = list(self._streams)
        self._end_timelines(request_ids, "error")
        self._fail_all(EngineDeadError(reason))
        if request_ids and self._is_ready:
            self._send(AbortRequests(request_ids))

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests in the engine (frees their KV blocks); late deltas are dropped."""
        live_ids = [i for i in request_ids if self._remove(i)]
        self._end_timelines(live_ids, "abort")
        if live_ids and self._is_ready:
            self._send(AbortRequests(live_ids))

    def _remove(self, request_id: str) -> bool:
        self._unstarted.pop(request_id, None)
        return self._streams.pop(request_id, None) is not None

    def _on_message(self, message: msgspec.Struct) -> None:
        if isinstance(message, StepOutputs):
            if message.step is not None and self.timelines is not None:
                self.timelines.on_step(message.step)
            num_tokens = self._route(message.deltas)
            if num_tokens and self.on_step_tokens is not None:
                self.on_step_tokens(num_tokens, self.engine_index)
            self.stats = message.stats
            if self.on_stats is not None:
                self.on_stats(message.stats, self.engine_index)
        elif isinstance(message, RequestFailed):
            stream = self._streams.get(message.request_id)
            if stream is not None:
                self._remove(message.request_id)
                self._end_timelines([message.request_id], "error")
                stream.put(RequestRejectedError(message.message))
        else:
            logger.warning("unexpected message from the worker: %s", type(message).__name__)

    def _route(self, deltas: list[RequestDelta]) -> int:
        """Each delta to its request's stream; the step's tokens, for `on_step_tokens`."""
        num_tokens = 0
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # aborted by the front; the worker had not seen the abort yet
            num_tokens += len(delta.new_token_ids) + self._unstarted.pop(delta.request_id, 0)
            if delta.finish_reason is not None:
                del self._streams[delta.request_id]
                reason = str(delta.finish_reason) if delta.error is None else "error"
                self._end_timelines([delta.request_id], reason)
            stream.put(delta if delta.error is None else RequestRejectedError(delta.error))
        return num_tokens

    def _end_timelines(self, request_ids: list[str], reason: str) -> None:
        if self.timelines is not None:
            now = time.monotonic()
            for request_id in request_ids:
                self.timelines.on_finished(request_id, reason, now)

    def _fail_all(self, error: Exception) -> None:
        self._end_timelines(list(self._streams), "error")
        streams = set(self._streams.values())
        self._streams.clear()
        self._unstarted.clear()
        for stream in streams:
            stream.put(error)
