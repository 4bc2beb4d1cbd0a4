"""EngineClient: how the front talks to an engine.

`EngineClient` routes each step's deltas to per-request `RequestStream`s on the event loop;
`ZmqEngineClient` moves the messages: the engine lives in a worker process and messages go over
ZMQ. It watches the worker, fails in-flight requests when it dies and starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from nanoserve.client.request_stream import RequestStream
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import (
    DEFAULT_WORKER_TIMEOUT_S,
    AbortRequests,
    AddRequest,
    EngineStats,
    Heartbeat,
    Ready,
    RequestFailed,
    Shutdown,
    StepOutputs,
    WorkerFailed,
)
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.worker.process import start_worker_group
from nanoserve.worker.ranks import WorkerGroup
from nanoserve.worker.transport import FrontSockets, IpcDirectory

logger = logging.getLogger("nanoserve.server")

POLL_S = 0.1  # how often the front checks that a silent worker is still alive


class _PrefixedLog(logging.LoggerAdapter):
    """A logger whose messages start with `extra["prefix"]`."""

    def process(self, msg, kwargs):
        return f"{self.extra['prefix']}{msg}", kwargs  # type: ignore[index]


class EngineDeadError(RuntimeError):
    """The worker died or is not ready: the request cannot be (or finish being) served."""


class EngineStartError(RuntimeError):
    """The worker failed before it became ready; `is_config_error`: a bad setting, not a bug."""

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
        self.on_ready: Callable[[Ready], None] | None = None  # each time a worker is ready
        self._is_ready = False
        self._is_accepting = True  # False once the server is shutting down
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its stream
        self._unstarted_ids: set[str] = set()  # added, no token yet (waiting or in prefill)
        self._shutdown_timer: asyncio.TimerHandle | None = None

    @property
    def is_ready(self) -> bool:
        """The worker is serving and the server takes new requests."""
        return self._is_ready and self._is_accepting

    @property
    def is_accepting(self) -> bool:
        return self._is_accepting

    @property
    def num_unstarted(self) -> int:
        return len(self._unstarted_ids)

    @property
    def num_engines(self) -> int:
        """Engines behind this client (each reports its own stats)."""
        return 1

    @property
    def num_in_flight(self) -> int:
        """Engine requests added and not yet finished or aborted (the router's load)."""
        return len(self._streams)

    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        raise NotImplementedError

    def _send(self, message: msgspec.Struct) -> bool:
        raise NotImplementedError

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: RequestStream,
    ) -> None:
        """Queue one (n == 1) engine request; its deltas will arrive on `stream`."""
        if not self._is_ready:
            raise EngineDeadError("the model worker is not ready")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = stream
        self._unstarted_ids.add(request_id)
        message = AddRequest(request_id, list(prompt_token_ids), params, time.monotonic())
        if not self._send(message):
            self._remove(request_id)
            raise EngineDeadError("the model worker is not reachable")

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
        self._fail_all(EngineDeadError(reason))
        if request_ids and self._is_ready:
            self._send(AbortRequests(request_ids))

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests in the engine (frees their KV blocks); late deltas are dropped."""
        live_ids = [i for i in request_ids if self._remove(i)]
        if live_ids and self._is_ready:
            self._send(AbortRequests(live_ids))

    def _remove(self, request_id: str) -> bool:
        self._unstarted_ids.discard(request_id)
        return self._streams.pop(request_id, None) is not None

    def _on_message(self, message: msgspec.Struct) -> None:
        if isinstance(message, StepOutputs):
            for delta in message.deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue  # aborted by the front; the worker had not seen the abort yet
                self._unstarted_ids.discard(delta.request_id)
                if delta.finish_reason is not None:
                    del self._streams[delta.request_id]
                stream.put(delta if delta.error is None else RequestRejectedError(delta.error))
            self.stats = message.stats
            if self.on_stats is not None:
                self.on_stats(message.stats, self.engine_index)
        elif isinstance(message, RequestFailed):
            stream = self._streams.get(message.request_id)
            if stream is not None:
                self._remove(message.request_id)
                stream.put(RequestRejectedError(message.message))
        else:
            logger.warning("unexpected message from the worker: %s", type(message).__name__)

    def _fail_all(self, error: Exception) -> None:
        streams = set(self._streams.values())
        self._streams.clear()
        self._unstarted_ids.clear()
        for stream in streams:
            stream.put(error)


class ZmqEngineClient(EngineClient):
    """The engine in a worker process, over ZMQ; restarts the worker when it dies."""

    def __init__(
        self,
        config: EngineConfig,
        log_level: str = "info",
        restart_delay_s: float = 1.0,
        worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
    ) -> None:
        super().__init__(config.data_parallel_rank)
        if not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0 seconds, got {worker_timeout_s}")
        self.config = config
        self.log_level = log_level
        self.restart_delay_s = restart_delay_s
        self.worker_timeout_s = worker_timeout_s
        # With data parallelism each line says which engine it is about.
        prefix = f"engine {config.data_parallel_rank}: " if config.data_parallel_size > 1 else ""
        self.log = _PrefixedLog(logger, {"prefix": prefix})
        # Several beats per timeout, so that one late beat is no alarm.
        self.heartbeat_interval_s = min(1.0, worker_timeout_s / 4)
        self._ipc = IpcDirectory()
        self._generation = 0
        self._sockets: FrontSockets | None = None
        self._worker: WorkerGroup | None = None
        self._supervisor: asyncio.Task | None = None
        self._is_closing = False
        self.start_error: EngineStartError | None = None  # why the first worker never got ready
        self.on_start_failed: Callable[[EngineStartError], None] | None = None

    async def start(self) -> None:
        """Start the worker in the background and return: until it is ready (the model loads),
        `is_ready` is False and /health answers 503. If the first worker fails before it is
        ready, `start_error` says why and `on_start_failed` is called."""
        self._supervisor = asyncio.create_task(
            self._start_then_supervise(), name="nanoserve-supervisor"
        )

    async def _start_then_supervise(self) -> None:
        self.log.info("starting the model worker; /health answers 503 until the model is ready")
        try:
            await self._start_worker()
        except Exception as error:
            self._stop_worker_now()
            self.start_error = (
                error if isinstance(error, EngineStartError) else EngineStartError(repr(error))
            )
            if self.on_start_failed is not None:
                self.on_start_failed(self.start_error)
            return
        await self._supervise()

    async def _start_worker(self) -> None:
        self._generation += 1
        addresses = self._ipc.addresses(self._generation)
        self._sockets = FrontSockets(addresses)
        start = time.perf_counter()
        self._worker = start_worker_group(
            self.config, addresses, self.log_level, self.heartbeat_interval_s
        )
        while True:
            message = await self._sockets.recv(POLL_S)
            if message is None:
                if not self._worker.is_alive():
                    raise EngineStartError(
                        f"the model worker exited with code {self._worker.returncode} "
                        "before it was ready (see its log above)"
                    )
                continue
            if isinstance(message, WorkerFailed) and message.is_config_error:
                raise EngineStartError(message.message, is_config_error=True)
            if isinstance(message, WorkerFailed):
                raise EngineStartError(
                    f"the model worker failed to start: {message.message} (its traceback is above)"
                )
            if isinstance(message, Ready):
                break
        self.info = message
        self._is_ready = True
        if self.on_ready is not None:
            self.on_ready(message)
        elapsed = time.perf_counter() - start
        self.log.info(
            "worker %d ready in %.1f s (weights %.2f s, KV sizing %.2f s, warm-up %.2f s, "
            "process start and imports %.2f s); KV cache: %d blocks x %d tokens = %d tokens; "
            "max_model_len %d",
            message.pid,
            elapsed,
            message.load_time_s,
            message.kv_sizing_time_s,
            message.warmup_time_s,
            elapsed - message.load_time_s - message.kv_sizing_time_s - message.warmup_time_s,
            message.num_kv_blocks,
            message.block_size,
            message.num_kv_blocks * message.block_size,
            message.max_model_len,
        )

    async def _supervise(self) -> None:
        """Receive outputs; when the worker dies, fail in-flight requests and start another."""
        while not self._is_closing:
            reason = await self._receive_until_worker_dies()
            if self._is_closing:
                return
            self._is_ready = False
            self.log.error(
                "model worker failed (%s); failing in-flight requests, restarting", reason
            )
            self._fail_all(EngineDeadError(f"the model worker failed ({reason})"))
            self._stop_worker_now()
            self.stats = EngineStats()
            if self.on_stats is not None:
                self.on_stats(self.stats, self.engine_index)
            while not self._is_closing:
                try:
                    await self._start_worker()
                    break
                except EngineStartError as e:
                    self.log.error("%s; retrying in %.1f s", e, self.restart_delay_s)
                    self._stop_worker_now()
                    await asyncio.sleep(self.restart_delay_s)

    async def _receive_until_worker_dies(self) -> str:
        """Route the worker's messages until it exits, fails, or is silent for too long."""
        assert self._sockets is not None and self._worker is not None
        last_heard = time.monotonic()
        while True:
            message = await self._sockets.recv(POLL_S)
            if message is None:
                if not self._worker.is_alive():
                    return f"exit code {self._worker.returncode}"
                silent_s = time.monotonic() - last_heard
                if silent_s > self.worker_timeout_s:
                    return (
                        f"no heartbeat for {silent_s:.1f} s (--worker-timeout "
                        f"{self.worker_timeout_s:g}): it is hung or stopped"
                    )
                continue
            last_heard = time.monotonic()
            if isinstance(message, WorkerFailed):
                self.log.error("worker error: %s\n%s", message.message, message.traceback)
                return message.message
            if not isinstance(message, Heartbeat):
                self._on_message(message)

    def _send(self, message: msgspec.Struct) -> bool:
        return self._sockets is not None and self._sockets.send(message)

    def _stop_worker_now(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None
        if self._sockets is not None:
            self._sockets.close()
            self._sockets = None

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Tell the worker to exit, wait for it (kill it after `timeout_s`), clean up sockets."""
        self._is_closing = True
        self._is_ready = False
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._worker is not None and self._sockets is not None:
            self._sockets.send(Shutdown())
            await asyncio.to_thread(self._worker.stop, timeout_s)
        self._stop_worker_now()
        self._ipc.cleanup()

    def kill_now(self) -> None:
        """Last resort (atexit): kill the worker and remove the socket directory."""
        self._stop_worker_now()
        self._ipc.cleanup()
