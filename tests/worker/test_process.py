"""The worker loop (with a scripted engine) and a real worker process over ZMQ."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FinishReason,
    Ready,
    RequestDelta,
    RequestFailed,
    Shutdown,
    StepOutputs,
)
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.worker.process import IDLE_POLL_S, WorkerProcess, serve_engine
from nanoserve.worker.transport import FrontSockets, IpcDirectory


class CountingEngine:
    """Engine API stand-in: each step gives every request its next integer, up to max_tokens."""

    max_model_len = 64
    vocab_size = 100

    def __init__(self) -> None:
        self.requests: dict[str, tuple[int, int]] = {}  # id -> (tokens made, max_tokens)
        self.num_steps = 0

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None) -> None:
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError("prompt too long")
        self.requests[request_id] = (0, params.max_tokens)

    def abort(self, request_ids) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestDelta]:
        self.num_steps += 1
        deltas = []
        for request_id, (num_made, max_tokens) in list(self.requests.items()):
            num_made += 1
            is_done = num_made == max_tokens
            finish = int(FinishReason.LENGTH) if is_done else None
            deltas.append(RequestDelta(request_id, [num_made], finish_reason=finish))
            if is_done:
                del self.requests[request_id]
            else:
                self.requests[request_id] = (num_made, max_tokens)
        return deltas

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests))


def run_loop(engine: CountingEngine, inbox: list) -> tuple[list, list[float]]:
    """Run serve_engine over `inbox` (None: nothing arrives on that call); return what it sent.

    Once the inbox is empty, a blocking (idle) wait gets Shutdown.
    """
    sent, timeouts = [], []

    def recv(timeout_s: float):
        timeouts.append(timeout_s)
        if inbox:
            return inbox.pop(0)
        return Shutdown() if timeout_s else None

    serve_engine(engine, recv, sent.append)
    return sent, timeouts


def test_loop_blocks_only_when_idle_and_steps_until_done() -> None:
    engine = CountingEngine()
    add = AddRequest("a", [1, 2], SamplingParams(max_tokens=3), 0.0)
    sent, timeouts = run_loop(engine, [None, add])
    # idle: waits (IDLE_POLL_S); after a message: drains without waiting; busy: never waits.
    assert timeouts == [IDLE_POLL_S, IDLE_POLL_S, 0, 0, 0, IDLE_POLL_S]
    tokens = [d.new_token_ids for m in sent for d in m.deltas]
    assert tokens == [[1], [2], [3]]
    assert sent[-1].deltas[0].finish_reason == FinishReason.LENGTH
    assert engine.num_steps == 3


def test_abort_when_idle_still_reports_stats() -> None:
    engine = CountingEngine()
    add = AddRequest("a", [1], SamplingParams(max_tokens=100), 0.0)
    sent, _ = run_loop(engine, [add, None, AbortRequests(["a"])])
    assert all(isinstance(m, StepOutputs) for m in sent)
    assert sent[-1].deltas == [] and sent[-1].stats.num_running == 0
    assert not engine.has_unfinished_requests()


def test_refused_request_is_reported_and_loop_goes_on() -> None:
    engine = CountingEngine()
    too_long = AddRequest("bad", list(range(64)), SamplingParams(), 0.0)
    ok = AddRequest("ok", [1], SamplingParams(max_tokens=1), 0.0)
    sent, _ = run_loop(engine, [too_long, ok])
    assert sent[0] == RequestFailed("bad", "prompt too long")
    assert [d.request_id for m in sent[1:] for d in m.deltas] == ["ok"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")


@pytest.mark.slow
def test_worker_process_serves_over_zmq_and_exits_on_shutdown(tiny_model: Path) -> None:
    async def scenario() -> None:
        ipc = IpcDirectory()
        addresses = ipc.addresses(1)
        sockets = FrontSockets(addresses)
        config = EngineConfig(model=str(tiny_model), num_kv_blocks=16)
        worker = WorkerProcess(config, addresses, log_level="warning")
        try:
            ready = None
            deadline = time.monotonic() + 120
            while ready is None and time.monotonic() < deadline:
                ready = await sockets.recv(1.0)
            assert isinstance(ready, Ready) and ready.pid == worker.pid
            assert (ready.num_kv_blocks, ready.block_size, ready.vocab_size) == (16, 16, 320)
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            assert sockets.send(AddRequest("r", [1, 2, 3], params, time.monotonic()))
            tokens, finish = [], None
            while finish is None:
                message = await sockets.recv(10.0)
                assert isinstance(message, StepOutputs)
                for delta in message.deltas:
                    tokens += delta.new_token_ids
                    finish = delta.finish_reason
            assert len(tokens) == 4 and finish == FinishReason.LENGTH
            assert sockets.send(Shutdown())
            worker.stop(timeout_s=10)
            assert worker.returncode == 0
        finally:
            worker.kill()
            sockets.close()
            ipc.cleanup()
        assert not ipc.path.exists()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("cores", "ranks", "threads"),
    [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 7), (16, 1, 15), (2, 2, 1), (8, 2, 3), (3, 4, 1)],
)
def test_small_machines_compute_on_every_core(cores, ranks, threads):
    from nanoserve.worker.process import worker_threads

    assert worker_threads(cores, ranks) == threads


def test_worker_environment_leaves_a_core_and_keeps_openmp_waiting(monkeypatch):
    from nanoserve.worker.process import worker_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    env = worker_environment()
    assert env["OMP_NUM_THREADS"] == "7" and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert worker_environment()["OMP_NUM_THREADS"] == "3"


def test_worker_environment_asks_for_huge_pages_unless_told_otherwise(monkeypatch):
    from nanoserve.worker.process import worker_environment

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert worker_environment()["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert worker_environment()["THP_MEM_ALLOC_ENABLE"] == "0"


def test_worker_environment_bounds_the_onednn_caches_unless_told_otherwise(monkeypatch):
    from nanoserve.worker.process import WORKER_KERNEL_CACHE_SIZE, worker_environment

    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
        assert worker_environment()[name] == str(WORKER_KERNEL_CACHE_SIZE)
        monkeypatch.setenv(name, "7")
        assert worker_environment()[name] == "7"
