"""The engine loop's incoming messages, readable ahead of their turn.

On a CPU a decode step of even a small model takes tens of milliseconds. When an editor's
next keystroke arrives while the previous keystroke's completion is being decoded, the front
aborts that completion and adds the new one; the loop would see both only after the step. So
a step may ask, between its layers, whether every one of its requests has been aborted since
it began (`Inbox.are_aborted`): that reads the messages waiting now and keeps them, in order,
for the loop, which handles them as if they had just arrived, while the step stops
(`StepAbandoned`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from nanoserve.common.protocol import AbortRequests


class Inbox:
    """The messages `recv(timeout_s)` returns (None: nothing came), with a look ahead."""

    def __init__(self, recv: Callable[[float], object]) -> None:
        self._recv = recv
        self._early: deque[object] = deque()  # read by `are_aborted`, not yet handled
        self._aborted: set[str] = set()  # request ids aborted by the messages read early

    def next(self, timeout_s: float) -> object | None:
        """The next message: one read early first, else `recv`'s."""
        if self._early:
            return self._early.popleft()
        self._aborted.clear()  # every message read early has been handled
        return self._recv(timeout_s)

    def are_aborted(self, request_ids: list[str]) -> bool:
        """Whether messages waiting now (or read early) abort every one of `request_ids`."""
        while (message := self._recv(0)) is not None:
            self._early.append(message)
            if isinstance(message, AbortRequests):
                self._aborted.update(message.request_ids)
        return bool(request_ids) and self._aborted.issuperset(request_ids)
