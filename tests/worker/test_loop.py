"""The engine loop (`worker/loop.py`) with a scripted engine: when it blocks, what it sends."""

from __future__ import annotations

from counting_engine import CountingEngine

from nanoserve.common.protocol import (
    AbortRequests,
    AddRequest,
    FinishReason,
    RequestFailed,
    Shutdown,
    StepOutputs,
)
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.worker.loop import IDLE_POLL_S, ready_message, serve_engine


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
    # idle: one look (its idle work is done at once), then waits (IDLE_POLL_S); after a
    # message: drains without waiting; busy: never waits (each step looks once, 0, whether
    # its requests were aborted meanwhile).
    assert timeouts == [0, IDLE_POLL_S] + [0, 0] * 3 + [IDLE_POLL_S]
    tokens = [d.new_token_ids for m in sent for d in m.deltas]
    assert tokens == [[1], [2], [3]]
    assert sent[-1].deltas[0].finish_reason == FinishReason.LENGTH
    assert engine.num_steps == 3


def test_idle_work_goes_on_slice_by_slice_while_nothing_runs() -> None:
    engine = CountingEngine()
    engine.idle_slices = 3
    add = AddRequest("a", [1, 2], SamplingParams(max_tokens=3), 0.0)
    sent, timeouts = run_loop(engine, [None, add])
    # A slice before the request, none during its three steps, the other two after it; the
    # inbox is only looked at (0) between slices and steps (and by each step), and waited on
    # once they are done.
    assert engine.idle_work_at_steps == [0, 3, 3]
    assert timeouts == [0] * 10 + [IDLE_POLL_S]
    assert [d.new_token_ids for m in sent for d in m.deltas] == [[1], [2], [3]]


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


def test_ready_says_what_the_engine_is() -> None:
    ready = ready_message(CountingEngine(), warmup_time_s=0.5)
    assert (ready.max_model_len, ready.vocab_size) == (64, 100)
    assert (ready.num_kv_blocks, ready.block_size) == (32, 16)
    assert (ready.load_time_s, ready.kv_sizing_time_s, ready.warmup_time_s) == (0.25, 0.125, 0.5)


def test_an_abort_that_arrives_during_a_step_abandons_it_then_is_handled():
    engine = CountingEngine()
    add_a = AddRequest("a", [1, 2], SamplingParams(max_tokens=5), 0.0)
    add_b = AddRequest("b", [1, 2], SamplingParams(max_tokens=2), 0.0)
    # a's first step runs (nothing waiting when it asks); its abort and b arrive during the
    # second, which stops; then b's steps run.
    sent, _ = run_loop(engine, [add_a, None, None, None, AbortRequests(["a"]), add_b])
    assert engine.abandoned_steps == [2]
    by_request = [(d.request_id, d.new_token_ids) for m in sent for d in m.deltas]
    assert by_request == [("a", [1]), ("b", [1]), ("b", [2])]
