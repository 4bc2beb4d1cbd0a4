"""The worker's heartbeat: proof to the front that the process is alive, whatever it computes.

A thread beside the worker loop sends `Heartbeat` at a fixed interval on a socket of its own
(ZMQ sockets are not shared between threads). It keeps beating through a long prefill step,
because PyTorch releases the GIL inside its operators; it stops when the process is stopped
(SIGSTOP), killed, or stuck in native code that holds the GIL. The front restarts a worker
whose heartbeat it has not heard for `--worker-timeout` seconds.
"""

from __future__ import annotations

import contextlib
import threading

import zmq

from nanoserve.common.protocol import Heartbeat, worker_codec


class HeartbeatThread:
    """Sends a Heartbeat to `address` every `interval_s` seconds until `stop()`."""

    def __init__(self, context: zmq.Context, address: str, interval_s: float) -> None:
        self._context = context
        self._address = address
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanoserve-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 4)  # a stopped front must not make beats pile up
        socket.connect(self._address)
        message = worker_codec().encode(Heartbeat())
        try:
            while not self._stopped.wait(self._interval_s):
                # A front that is not reading hears the next beat; none piles up meanwhile.
                with contextlib.suppress(zmq.Again):
                    socket.send(message, flags=zmq.NOBLOCK)
        finally:
            socket.close(linger=0)

    def stop(self) -> None:
        """Stop beating and close the thread's socket (before its context is terminated)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
