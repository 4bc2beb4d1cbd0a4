"""The front's end of the ZMQ PUSH/PULL sockets to a worker, and their private ipc directory.

The front binds a fresh pair of sockets for every worker it starts (a "generation"), so nothing
queued for a dead worker can ever reach its replacement. The worker connects to them
(`worker/transport.py`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from nanoserve.common.protocol import WorkerAddresses, front_codec


class IpcDirectory:
    """A private (0700) temp directory for ipc:// socket files, removed by `cleanup()`.

    Closing a bound socket leaves its file (libzmq removes only those of wildcard binds), so a
    generation's files are removed when it ends (`remove`): the directory holds the live one's.
    """

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="nanoserve-"))
        os.chmod(self.path, 0o700)

    def addresses(self, generation: int) -> WorkerAddresses:
        return WorkerAddresses(
            to_worker=f"ipc://{self._file(generation, 'to_worker')}",
            to_front=f"ipc://{self._file(generation, 'to_front')}",
        )

    def remove(self, generation: int) -> None:
        """Remove a generation's socket files (its sockets are closed, its worker gone)."""
        for direction in ("to_worker", "to_front"):
            self._file(generation, direction).unlink(missing_ok=True)

    def _file(self, generation: int, direction: str) -> Path:
        return self.path / f"{direction}_{generation}.sock"

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

    async def recv(self, timeout_s: float) -> msgspec.Struct | None:
        """The next ToFront message, or None if none came within `timeout_s`."""
        if not await self._pull.poll(timeout=int(timeout_s * 1000)):
            return None
        return self._codec.decode((await self._pull.recv(copy=False)).buffer)

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
