"""ZmqEngineClient: the engine in a worker process, over ZMQ, watched and restarted.

The client spawns the worker (`worker_process.py`), binds its sockets (`transport.py`) and runs
one supervisor task: it routes the worker's outputs to the request streams (`EngineClient`),
hears its heartbeat, and when the worker exits, reports a failure or falls silent for
`worker_timeout_s`, fails the requests in flight and starts a new worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from nanoserve.client.engine_client import EngineClient, EngineDeadError, EngineStartError
from nanoserve.client.transport import FrontSockets, IpcDirectory
from nanoserve.client.worker_process import WorkerGroup, start_worker_group
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import (
    DEFAULT_WORKER_TIMEOUT_S,
    EngineStats,
    Heartbeat,
    Ready,
    Shutdown,
    WorkerFailed,
)

logger = logging.getLogger("nanoserve.server")

POLL_S = 0.1  # how often the front checks that a silent worker is still alive


class _PrefixedLog(logging.LoggerAdapter):
    """A logger whose messages start with `extra["prefix"]`."""

    def process(self, msg, kwargs):
        return f"{self.extra['prefix']}{msg}", kwargs  # type: ignore[index]


def startup_breakdown(ready: Ready, elapsed_s: float) -> str:
    """'12.3 s (process start 0.2 s, imports 2.1 s, ...)': a worker's start-up, stage by stage
    in the order they ran; the process start is what the worker's own clocks did not see."""
    stages = {
        "imports": ready.imports_time_s,
        "fast paths": ready.setup_time_s,  # CPU kernels (a build, if one runs), parallel group
        "weights": ready.load_time_s,
        "linear methods": ready.prepare_time_s,  # packing the weights
        "KV cache and step runners": ready.kv_sizing_time_s,
        "warm-up": ready.warmup_time_s,
    }
    stages = {"process start": elapsed_s - sum(stages.values()), **stages}
    return f"{elapsed_s:.1f} s ({', '.join(f'{k} {v:.2f} s' for k, v in stages.items())})"


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
        self._launched_at = 0.0  # perf_counter() when the current worker was started
        self._supervisor: asyncio.Task | None = None
        self._is_closing = False

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

    def launch(self) -> None:
        """Start the first worker now, before the event loop runs, so that its imports and
        model load overlap the rest of the front's start-up (the tokenizer, the app); `start`
        then waits for this worker instead of starting one."""
        if self._worker is None:
            self._launch_worker()

    def _launch_worker(self) -> None:
        self._generation += 1
        addresses = self._ipc.addresses(self._generation)
        self._sockets = FrontSockets(addresses)
        self._launched_at = time.perf_counter()
        self._worker = start_worker_group(
            self.config, addresses, self.log_level, self.heartbeat_interval_s
        )

    async def _start_worker(self) -> None:
        if self._worker is None:  # not launched early, or a restart
            self._launch_worker()
        assert self._sockets is not None and self._worker is not None
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
        self.log.info(
            "worker %d ready in %s; KV cache: %d blocks x %d tokens = %d tokens; max_model_len %d",
            message.pid,
            startup_breakdown(message, time.perf_counter() - self._launched_at),
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
            self._ipc.remove(self._generation)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Tell the worker to exit, wait for it (kill it after `timeout_s`), clean up sockets.

        A worker that is still starting serves nothing and reads no message until its model is
        loaded: it is killed at once, so that Ctrl-C while a model loads exits in a second."""
        is_serving = self._is_ready
        self._is_closing = True
        self._is_ready = False
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        self._fail_all(EngineDeadError("the server is shutting down"))
        if is_serving and self._worker is not None and self._sockets is not None:
            self._sockets.send(Shutdown())
            await asyncio.to_thread(self._worker.stop, timeout_s)
        elif self._worker is not None:
            self.log.info("stopping the model worker, which was still starting")
        self._stop_worker_now()
        self._ipc.cleanup()

    def kill_now(self) -> None:
        """Last resort (atexit): kill the worker and remove the socket directory."""
        self._stop_worker_now()
        self._ipc.cleanup()
