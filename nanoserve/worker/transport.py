"""ZMQ PUSH/PULL sockets between the front and the worker, and the private ipc directory.

The front binds a fresh pair of sockets for every worker it starts (a "generation"), so nothing
queued for a dead worker can ever reach its replacement. The worker connects to them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from nanoserve.common.protocol import front_codec, worker_codec


@dataclass(frozen=True)
class WorkerAddresses:
    """Where the worker reads requests from and writes outputs to."""

    to_worker: str
    to_front: str


class IpcDirectory:
    """A private (0700) temp directory for ipc:// socket files, removed by `cleanup()`."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="nanoserve-"))
        os.chmod(self.path, 0o700)

    def addresses(self, generation: int) -> WorkerAddresses:
        return WorkerAddresses(
            to_worker=f"ipc://{self.path}/to_worker_{generation}.sock",
            to_front=f"ipc://{self.path}/to_front_{generation}.sock",
        )

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class FrontSockets:
    """The front's end: binds both sockets; async receive of ToFront, non-blocking send.

    Sending never waits: the PUSH queue is unbounded, and with no worker connected (it died)
    `send` returns False and the message is dropped — nothing should be sent to a dead worker.
    """

    def __init__(self, addresses: WorkerAddresses) -> None:
        self._codec = front_codec()
        self._push: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # 0: no limit on queued messages
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(addresses.to_worker)
        self._pull = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(addresses.to_front)

    def send(self, message: msgspec.Struct) -> bool:
        try:
            self._push.send(self._codec.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    async def recv(self, timeout_s: float):
        """The next ToFront message, or None if none came within `timeout_s`."""
        if not await self._pull.poll(timeout=int(timeout_s * 1000)):
            return None
        return self._codec.decode((await self._pull.recv(copy=False)).buffer)

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)


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

    def recv(self, timeout_s: float | None):
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
