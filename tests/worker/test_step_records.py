"""StepRecorder in the engine loop with a real engine: a record only for the steps that ran a
request that asked, each chunk where the request's counters say, the batch around it, and the
preempted ones named."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.client.request_timeline import RequestTimelines
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import AddRequest, Shutdown, StepOutputs, StepRecord
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.core.engine import Engine
from nanoserve.worker.loop import serve_engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def make_engine(checkpoint: Path, **overrides: object) -> Engine:
    config = {"model": str(checkpoint), "dtype": "float32", "device": "cpu", "max_model_len": 128}
    return Engine(EngineConfig(**{**config, **overrides}))


def run(engine: Engine, adds: list[AddRequest]) -> list[StepOutputs]:
    """Every request added at once, run to the end; what the loop sent."""
    inbox: list[object] = list(adds)
    sent: list[StepOutputs] = []

    def recv(timeout_s: float) -> object:
        if inbox:
            return inbox.pop(0)
        return Shutdown() if timeout_s else None

    serve_engine(engine, recv, sent.append)  # type: ignore[arg-type]
    return sent


def add(request_id: str, num_prompt: int, max_tokens: int, record: bool) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [(7 * i + len(request_id)) % 256 for i in range(num_prompt)]
    return AddRequest(request_id, prompt, params, 0.0, record_timeline=record)


def records(sent: list[StepOutputs]) -> list[StepRecord]:
    return [m.step for m in sent if m.step is not None]


def test_only_the_requests_that_asked_are_recorded_chunk_by_chunk(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, max_num_batched_tokens=16)
    sent = run(engine, [add("seen", 40, 5, True), add("unseen", 10, 30, False)])
    steps = records(sent)
    assert all(c.request_id == "seen" for s in steps for c in s.chunks)
    chunks = [(c.num_computed_tokens, c.num_tokens) for s in steps for c in s.chunks]
    # A 40-token prompt in chunks of the 16-token budget (the other request takes its share),
    # then one token per decode step; the last sampled token is never run.
    positions = [p for start, n in chunks for p in range(start, start + n)]
    assert positions == list(range(40 + 5 - 1))
    assert all(n == 1 for start, n in chunks if start >= 40)
    assert all(s.num_batched_tokens <= 16 and 1 <= s.num_requests <= 2 for s in steps)
    assert any(s.num_requests == 2 for s in steps)  # batched with the unseen one
    indexes = [s.step_index for s in steps]
    assert indexes == sorted(set(indexes))
    assert all(s.start_time <= s.end_time for s in steps)
    # Steps after "seen" finished ran only "unseen": no record.
    assert len([m for m in sent if m.deltas]) > len(steps)


def test_nothing_is_recorded_when_nobody_asks(checkpoint: Path) -> None:
    sent = run(make_engine(checkpoint), [add("a", 10, 3, False), add("b", 12, 3, False)])
    assert records(sent) == [] and len(sent) >= 3


def test_a_preemption_names_the_request_and_it_is_recomputed(checkpoint: Path) -> None:
    # 10 blocks of 16 tokens: two requests of 40 + 60 tokens cannot both finish in place.
    engine = make_engine(checkpoint, num_kv_blocks=10, enable_prefix_caching=False)
    sent = run(engine, [add("old", 40, 60, True), add("new", 40, 60, True)])
    steps = records(sent)
    preempting = [s for s in steps if s.preempted_ids]
    assert preempting and preempting[0].preempted_ids == ["new"]
    after = steps[steps.index(preempting[0]) + 1 :]
    first_again = next(c for s in after for c in s.chunks if c.request_id == "new")
    # Readmitted with nothing cached (prefix caching is off): prompt and outputs run again.
    assert first_again.num_computed_tokens == 0 and first_again.num_tokens > 40


def test_the_fronts_timeline_of_a_preempted_request_is_in_order(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, num_kv_blocks=10, enable_prefix_caching=False)
    sent = run(engine, [add("old", 40, 60, True), add("new", 40, 60, True)])
    timelines = RequestTimelines()
    for request_id in ("old", "new"):
        timelines.add(request_id, request_id, 40, 0.0, 0.0)
    for message in sent:
        if message.step is not None:
            timelines.on_step(message.step)
        for delta in message.deltas:
            if delta.finish_reason is not None:
                timelines.on_finished(delta.request_id, str(delta.finish_reason), 0.0)
    new = timelines.as_json("new")["requests"][0]  # type: ignore[index]
    kinds = [e["type"] for e in new["events"]]
    first_decode, preempted = kinds.index("decode"), kinds.index("preempted")
    assert kinds[:4] == ["arrived", "queued", "admitted", "prefill"]
    assert first_decode < preempted and kinds[preempted + 1 : preempted + 3] == [
        "admitted",
        "recompute",
    ]
    assert kinds[-1] == "finished" and new["events"][-1]["reason"] == "length"
    # 60 tokens sampled: one after the prompt, one after each recompute, the rest decoding.
    assert new["num_preemptions"] >= 1
    assert new["num_output_tokens"] == 60 - 1 - new["num_preemptions"]
    old = timelines.as_json("old")["requests"][0]  # type: ignore[index]
    assert old["num_preemptions"] == 0 and old["num_output_tokens"] == 59
