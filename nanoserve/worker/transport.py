"""The worker's end of the ZMQ PUSH/PULL sockets to the front (blocking; the front binds them,
`client/transport.py`)."""

from __future__ import annotations

import msgspec
import zmq

from nanoserve.common.protocol import WorkerAddresses, worker_codec


class WorkerSockets:
    """The worker's end (blocking): receive ToWorker, send ToFront."""

    def __init__(self, addresses: WorkerAddresses) -> None:
        self.context = zmq.Context()  # also for the heartbeat thread's socket
        self.addresses = addresses
        self._codec = worker_codec()
        self._pull = self.context.socket(zmq.PULL)
        self._pull.connect(addresses.to_worker)
        self._push = self.context.socket(zmq.PUSH)
        self._push.connect(addresses.to_front)

    def send(self, message: msgspec.Struct) -> None:
        self._push.send(self._codec.encode(message), copy=False)

    def recv(self, timeout_s: float | None) -> msgspec.Struct | None:
        """The next ToWorker message; None if none within `timeout_s` (0: don't wait)."""
        if timeout_s == 0:
            try:
                data = self._pull.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
        else:
            timeout_ms = -1 if timeout_s is None else int(timeout_s * 1000)
            if not self._pull.poll(timeout=timeout_ms):
                return None
            data = self._pull.recv(copy=False)
        return self._codec.decode(data.buffer)

    def close(self, linger_s: float = 1.0) -> None:
        """Close, giving queued outputs (e.g. WorkerFailed) up to `linger_s` to leave."""
        self._push.close(linger=int(linger_s * 1000))
        self._pull.close(linger=0)
        self.context.term()
