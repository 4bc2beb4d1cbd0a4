"""InProcessEngineClient with a scripted engine: it behaves as the ZMQ client does with a worker
(Ready, streams, aborts, refusals, stats, shutdown, a failing engine), and leaves no thread."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import pytest
from counting_engine import CountingEngine

from nanoserve.client.engine_client import EngineDeadError, RequestRejectedError
from nanoserve.client.inprocess import InProcessEngineClient
from nanoserve.client.request_stream import RequestStream
from nanoserve.common.protocol import EngineStats, FinishReason, Ready
from nanoserve.common.sampling_params import SamplingParams

DEADLINE_S = 10.0  # a condition not met by then is a bug, not a slow machine


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} within {DEADLINE_S} s"
        await asyncio.sleep(0.005)  # paces the poll


async def started(engine: CountingEngine) -> InProcessEngineClient:
    client = InProcessEngineClient(engine)
    await client.start()
    await wait_until(lambda: client.is_ready, "ready")
    return client


async def tokens_of(stream: RequestStream) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    while True:
        delta = await asyncio.wait_for(stream.get(), DEADLINE_S)
        tokens += delta.new_token_ids
        if delta.finish_reason is not None:
            return tokens, delta.finish_reason


def assert_thread_ended(client: InProcessEngineClient) -> None:
    """The client's engine thread is gone (joined), not merely told to stop."""
    assert client._thread is not None and client._thread not in threading.enumerate()


def test_ready_after_warm_up_then_streams_every_token() -> None:
    async def scenario() -> None:
        engine = CountingEngine()
        client = InProcessEngineClient(engine)
        readies: list[Ready] = []
        client.on_ready = readies.append
        stats: list[tuple[EngineStats, int]] = []
        client.on_stats = lambda s, index: stats.append((s, index))
        assert not client.is_ready
        await client.start()
        await wait_until(lambda: client.is_ready, "ready")
        assert engine.num_warm_ups == 1 and readies == [client.info]
        assert client.info is not None and client.info.pid == os.getpid()
        assert (client.info.max_model_len, client.info.vocab_size) == (64, 100)
        assert (client.info.num_kv_blocks, client.info.block_size) == (32, 16)
        assert (client.info.load_time_s, client.info.kv_sizing_time_s) == (0.25, 0.125)
        try:
            streams = {name: RequestStream() for name in ("a", "b")}
            for name, max_tokens in (("a", 3), ("b", 5)):
                params = SamplingParams(max_tokens=max_tokens)
                client.add_request(name, [1, 2], params, streams[name])
            assert client.num_in_flight == 2 and client.num_unstarted == 2
            assert await tokens_of(streams["a"]) == ([1, 2, 3], FinishReason.LENGTH)
            assert await tokens_of(streams["b"]) == ([1, 2, 3, 4, 5], FinishReason.LENGTH)
            assert client.num_in_flight == 0 and client.num_unstarted == 0
            assert engine.thread_ids and threading.get_ident() not in engine.thread_ids
            await wait_until(lambda: client.stats.num_running == 0, "idle in the stats")
            assert stats and all(index == 0 for _, index in stats)
            assert stats[-1][0] == client.stats
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_a_request_id_in_use_is_refused_and_a_refused_request_fails_alone() -> None:
    async def scenario() -> None:
        client = await started(CountingEngine())
        try:
            stream = RequestStream()
            client.add_request("long", list(range(64)), SamplingParams(), stream)
            with pytest.raises(ValueError, match="already in use"):
                client.add_request("long", [1], SamplingParams(), RequestStream())
            with pytest.raises(RequestRejectedError, match="prompt too long"):
                await asyncio.wait_for(stream.get(), DEADLINE_S)
            ok = RequestStream()
            client.add_request("ok", [1], SamplingParams(max_tokens=2), ok)
            assert await tokens_of(ok) == ([1, 2], FinishReason.LENGTH)
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_abort_stops_a_request_and_reports_its_freed_room() -> None:
    async def scenario() -> None:
        engine = CountingEngine()
        client = await started(engine)
        engine.step_gate = threading.Semaphore(0)  # each step waits for one release
        try:
            stream = RequestStream()
            client.add_request("a", [1], SamplingParams(max_tokens=100), stream)
            engine.step_gate.release()
            assert (await asyncio.wait_for(stream.get(), DEADLINE_S)).new_token_ids == [1]
            client.abort(["a"])  # before or during step 2: its token is dropped, if any
            assert client.num_in_flight == 0
            engine.step_gate.release()
            # The loop reads the abort before its next step and reports the freed room at once.
            await wait_until(lambda: not engine.requests, "aborted in the engine")
            await wait_until(lambda: client.stats.num_running == 0, "the abort in the stats")
            # A request added after the abort: once its token is here, a late one of "a" would be.
            later = RequestStream()
            client.add_request("b", [1], SamplingParams(max_tokens=1), later)
            engine.step_gate.release()
            assert await tokens_of(later) == ([1], FinishReason.LENGTH)
            assert stream.get_nowait() is None and engine.num_steps <= 3
        finally:
            engine.step_gate.release(100)
            await client.shutdown()

    asyncio.run(scenario())


def test_shutdown_ends_streams_and_joins_the_thread() -> None:
    async def scenario() -> InProcessEngineClient:
        engine = CountingEngine()
        client = await started(engine)
        stream = RequestStream()
        client.add_request("a", [1], SamplingParams(max_tokens=10_000), stream)
        await asyncio.wait_for(stream.get(), DEADLINE_S)
        await client.shutdown(timeout_s=DEADLINE_S)
        assert not client.is_ready and not client.is_running
        with pytest.raises(EngineDeadError, match="shutting down"):
            while True:
                await asyncio.wait_for(stream.get(), DEADLINE_S)
        with pytest.raises(EngineDeadError):
            client.add_request("b", [1], SamplingParams(), RequestStream())
        return client

    assert_thread_ended(asyncio.run(scenario()))


def test_the_grace_period_ends_unfinished_streams() -> None:
    async def scenario() -> InProcessEngineClient:
        client = await started(CountingEngine())
        try:
            stream = RequestStream()
            client.add_request("a", [1], SamplingParams(max_tokens=10_000), stream)
            client.begin_shutdown(grace_s=0.05)
            assert not client.is_ready
            with pytest.raises(EngineDeadError, match="the server is shutting down"):
                while True:
                    await asyncio.wait_for(stream.get(), DEADLINE_S)
            assert client.num_in_flight == 0
        finally:
            await client.shutdown()
        return client

    assert_thread_ended(asyncio.run(scenario()))


def test_an_engine_that_raises_fails_its_requests_and_is_not_ready() -> None:
    async def scenario() -> InProcessEngineClient:
        client = await started(CountingEngine(fail_at_step=3))
        try:
            stream = RequestStream()
            client.add_request("a", [1], SamplingParams(max_tokens=100), stream)
            failed = r"the model worker failed \(RuntimeError: step 3 broke\)"
            with pytest.raises(EngineDeadError, match=failed):
                while True:
                    await asyncio.wait_for(stream.get(), DEADLINE_S)
            await wait_until(lambda: not client.is_running, "the engine thread ended")
            assert not client.is_ready and client.stats == EngineStats()
            with pytest.raises(EngineDeadError):
                client.add_request("b", [1], SamplingParams(), RequestStream())
        finally:
            await client.shutdown()
        return client

    assert_thread_ended(asyncio.run(scenario()))


@pytest.mark.parametrize(
    ("error", "is_config_error"),
    [(ValueError("max_model_len 9 is too long"), True), (RuntimeError("out of memory"), False)],
)
def test_a_warm_up_failure_is_a_start_error(error: Exception, is_config_error: bool) -> None:
    async def scenario() -> InProcessEngineClient:
        client = InProcessEngineClient(CountingEngine(fail_warm_up=error))
        failures = []
        client.on_start_failed = failures.append
        await client.start()
        try:
            await wait_until(lambda: client.start_error is not None, "a start error")
            assert failures == [client.start_error] and not client.is_ready
            assert client.start_error.is_config_error == is_config_error
            assert str(error) in str(client.start_error)
        finally:
            await client.shutdown()
        return client

    assert_thread_ended(asyncio.run(scenario()))
