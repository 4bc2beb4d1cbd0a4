"""InProcessEngineClient: an engine object of this process, run by the worker's own loop on a
thread, behind the same `EngineClient` interface as a worker process.

The thread does what a worker process does: warm the engine up, say Ready, then run
`serve_engine` (drain → step → send) until Shutdown. Messages cross between the threads as they
cross the process boundary, encoded and decoded with the wire's codecs, so that neither side
holds an object the other one changes; outputs reach the event loop through
`loop.call_soon_threadsafe`. There is no heartbeat and no restart: an engine that raises fails
the requests in flight and leaves the client not ready (/health 503).

The engine is duck-typed (`worker.loop.ServedEngine`), so this module never imports the core;
the caller builds the engine (tests: `tests/servers.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

import msgspec

from nanoserve.client.engine_client import EngineClient, EngineDeadError, EngineStartError
from nanoserve.common.protocol import EngineStats, Ready, Shutdown, front_codec, worker_codec
from nanoserve.worker.loop import ServedEngine, ready_message, serve_engine

logger = logging.getLogger("nanoserve.server")


class InProcessEngineClient(EngineClient):
    """Serves requests with `engine`, stepped on a thread of this process."""

    def __init__(self, engine: ServedEngine, engine_index: int = 0) -> None:
        super().__init__(engine_index)
        self.engine = engine
        # The two ends of the wire, each used on its own thread only.
        self._engine_end = worker_codec()  # engine thread: decodes ToWorker, encodes ToFront
        self._front_end = front_codec()  # event loop: encodes ToWorker, decodes ToFront
        self._inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future[None] | None = None  # done once the thread has ended
        self._is_closing = False

    async def start(self) -> None:
        """Start the engine thread and return; `is_ready` once it has warmed up."""
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """The engine thread is alive (it ends on shutdown, or when the engine fails)."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        """The engine thread: warm up, say Ready, run the loop; then report how it ended."""
        error: Exception | None = None
        try:
            started = time.perf_counter()
            self.engine.warm_up()
            self._post(ready_message(self.engine, warmup_time_s=time.perf_counter() - started))
            serve_engine(self.engine, self._recv, self._post, lambda: self._is_closing)
        except Exception as e:
            logger.exception("the in-process engine failed")
            error = e
        finally:
            self._call_on_loop(self._on_thread_end, error)

    def _recv(self, timeout_s: float) -> msgspec.Struct | None:
        """The loop's receive (engine thread): the next message, or None after `timeout_s`."""
        try:
            data = self._inbox.get(timeout=timeout_s) if timeout_s else self._inbox.get_nowait()
        except queue.Empty:
            return None
        return self._engine_end.decode(data)

    def _post(self, message: msgspec.Struct) -> None:
        """The loop's send (engine thread): hand `message`, encoded, to the event loop."""
        self._call_on_loop(self._receive, self._engine_end.encode(message))

    def _call_on_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens
            self._loop.call_soon_threadsafe(callback, *args)

    def _receive(self, data: bytes) -> None:
        """On the event loop: Ready, or outputs for the request streams."""
        message = self._front_end.decode(data)
        if isinstance(message, Ready):
            self.info = message
            self._is_ready = not self._is_closing
            if self.on_ready is not None:
                self.on_ready(message)
        else:
            self._on_message(message)

    def _on_thread_end(self, error: Exception | None) -> None:
        """On the event loop: the thread ended, after Shutdown or because the engine failed."""
        assert self._stopped is not None
        self._stopped.set_result(None)
        if error is None or self._is_closing:
            return
        if self.info is None:  # as a worker that fails at start-up: a bad setting or a bug
            message = str(error) if isinstance(error, ValueError) else repr(error)
            self.start_error = EngineStartError(message, isinstance(error, ValueError))
            if self.on_start_failed is not None:
                self.on_start_failed(self.start_error)
            return
        self._is_ready = False
        reason = f"{type(error).__name__}: {error}"  # as a worker process reports it
        self._fail_all(EngineDeadError(f"the model worker failed ({reason})"))
        self.stats = EngineStats()
        if self.on_stats is not None:
            self.on_stats(self.stats, self.engine_index)

    def _send(self, message: msgspec.Struct) -> bool:
        if not self.is_running or self._is_closing:
            return False
        self._inbox.put(self._front_end.encode(message))
        return True

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (it ends after the step it is in) and join the engine thread."""
        self._is_closing = True
        self._is_ready = False
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._thread is None or self._stopped is None:
            return
        self._inbox.put(self._front_end.encode(Shutdown()))
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped), timeout_s)
        except asyncio.TimeoutError:
            logger.warning("the engine thread did not stop within %.1f s", timeout_s)
            return
        self._thread.join()  # it has reported its end: only its last instructions are left

    def kill_now(self) -> None:
        """A thread cannot be killed: ask its loop to stop at the next message it reads."""
        self._is_closing = True
        self._inbox.put(self._front_end.encode(Shutdown()))
