"""RequestStream: the deltas of one API request on their way from the engine to its handler.

The engine does not wait for readers: a step's deltas are put here whether or not the handler
has taken the last ones (it may be blocked writing to a client that reads slowly). So that a
slow reader costs only the tokens it has not read yet, never a growing queue of messages, the
stream holds at most one pending delta per engine request: a delta that arrives before the
reader took the previous one of the same request is merged into it.
"""

from __future__ import annotations

import asyncio

from nanoserve.common.protocol import RequestDelta


def merge_deltas(earlier: RequestDelta, later: RequestDelta) -> RequestDelta:
    """One delta with the tokens of both, in order; the later one's ending.

    What only a request's first delta carries (cached tokens, queue time, prompt logprobs) is
    the earlier one's; an error is whichever delta has one.
    """
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = [*(earlier.logprobs or []), *(later.logprobs or [])]
    first_queue_time = earlier.queue_time_s
    return RequestDelta(
        request_id=earlier.request_id,
        new_token_ids=[*earlier.new_token_ids, *later.new_token_ids],
        logprobs=logprobs,
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
        num_cached_tokens=earlier.num_cached_tokens,  # set on a request's first delta
        queue_time_s=first_queue_time if first_queue_time is not None else later.queue_time_s,
        prompt_logprobs=(
            earlier.prompt_logprobs
            if earlier.prompt_logprobs is not None
            else later.prompt_logprobs
        ),
        error=later.error if later.error is not None else earlier.error,
    )


class RequestStream:
    """Deltas of one API request's engine requests (its n choices), merged while unread.

    `get` returns pending deltas in arrival order, then raises the engine's error (e.g.
    EngineDeadError) if one was put: it ends the stream.
    """

    def __init__(self) -> None:
        self._pending: dict[str, RequestDelta] = {}  # engine request id -> unread tokens
        self._error: Exception | None = None
        self._has_items = asyncio.Event()

    @property
    def num_pending(self) -> int:
        """Engine requests with unread tokens (at most the request's number of choices)."""
        return len(self._pending)

    def put(self, item: RequestDelta | Exception) -> None:
        if isinstance(item, Exception):
            self._error = self._error or item
        else:
            earlier = self._pending.get(item.request_id)
            merged = item if earlier is None else merge_deltas(earlier, item)
            self._pending[item.request_id] = merged
        self._has_items.set()

    async def get(self) -> RequestDelta:
        while not self._pending and self._error is None:
            self._has_items.clear()
            await self._has_items.wait()
        return self._take()

    def get_nowait(self) -> RequestDelta | None:
        """The next delta if one is already here (to handle bursts together), else None."""
        if not self._pending and self._error is None:
            return None
        return self._take()

    def _take(self) -> RequestDelta:
        if self._pending:
            return self._pending.pop(next(iter(self._pending)))
        assert self._error is not None
        raise self._error
