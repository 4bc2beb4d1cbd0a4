"""A request's stream holds at most one pending delta per engine request: a reader that falls
behind gets the unread tokens merged, in order, never a growing queue."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve.client.engine_client import EngineDeadError
from nanoserve.client.request_stream import RequestStream, merge_deltas
from nanoserve.common.protocol import FinishReason, RequestDelta, TokenLogprobs


def logprobs(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -1.0, 1, [token_id], [-1.0])


def test_merge_keeps_order_and_the_ends() -> None:
    first = RequestDelta("a-0", [1, 2], [logprobs(1), logprobs(2)], None, None, 16, 0.5)
    second = RequestDelta("a-0", [3], [logprobs(3)], int(FinishReason.STOP), 3, 0, None)
    merged = merge_deltas(first, second)
    assert merged.new_token_ids == [1, 2, 3]
    assert [e.token_id for e in merged.logprobs or []] == [1, 2, 3]
    assert (merged.finish_reason, merged.stop_reason) == (FinishReason.STOP, 3)
    assert (merged.num_cached_tokens, merged.queue_time_s) == (16, 0.5)  # the first delta's
    plain = merge_deltas(RequestDelta("b", [1]), RequestDelta("b", [2], queue_time_s=0.25))
    assert plain.logprobs is None and plain.queue_time_s == 0.25


def test_merge_keeps_the_first_deltas_prompt_logprobs_and_any_error() -> None:
    """An echo's prompt logprobs ride on the first delta: a reader that falls behind by one
    step must still get them (they were dropped, and the echoed prompt came back unscored)."""
    prompt = [logprobs(7), logprobs(8)]
    first = RequestDelta("a-0", [1], [logprobs(1)], queue_time_s=0.5, prompt_logprobs=prompt)
    merged = merge_deltas(first, RequestDelta("a-0", [2], [logprobs(2)]))
    assert [e.token_id for e in merged.prompt_logprobs or []] == [7, 8]
    failed = RequestDelta("a-0", [], finish_reason=int(FinishReason.ABORT), error="refused")
    assert merge_deltas(first, failed).error == "refused"
    assert merge_deltas(RequestDelta("b", [], error="bad"), RequestDelta("b", [])).error == "bad"


def test_an_unread_stream_stays_one_delta_per_choice() -> None:
    async def scenario() -> None:
        stream = RequestStream()
        for step in range(1000):  # the engine runs on while nobody reads
            for choice in range(4):
                stream.put(RequestDelta(f"r-{choice}", [step]))
        assert stream.num_pending == 4
        deltas = [await stream.get() for _ in range(4)]
        assert [d.request_id for d in deltas] == ["r-0", "r-1", "r-2", "r-3"]
        assert all(d.new_token_ids == list(range(1000)) for d in deltas)
        assert stream.get_nowait() is None

    asyncio.run(scenario())


def test_pending_tokens_come_before_the_error() -> None:
    async def scenario() -> None:
        stream = RequestStream()
        stream.put(RequestDelta("a", [7]))
        stream.put(EngineDeadError("the model worker failed"))
        stream.put(EngineDeadError("a second error is not the one reported"))
        assert (await stream.get()).new_token_ids == [7]
        with pytest.raises(EngineDeadError, match="worker failed"):
            await stream.get()

    asyncio.run(scenario())


def test_get_waits_for_a_put() -> None:
    async def scenario() -> None:
        stream = RequestStream()
        reader = asyncio.ensure_future(stream.get())
        for _ in range(3):  # each yield lets the reader run on, up to where it waits
            await asyncio.sleep(0)
        assert not reader.done()
        stream.put(RequestDelta("a", [1]))
        assert (await asyncio.wait_for(reader, 1)).new_token_ids == [1]

    asyncio.run(scenario())
