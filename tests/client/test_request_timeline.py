"""RequestTimelines: step records turned into each request's events, in order (under chunked
prefill, batching and preemption), bounded in requests and in events per request."""

from __future__ import annotations

import pytest

from nanoserve.client.request_timeline import RequestTimelines
from nanoserve.common.protocol import ScheduledChunk, StepRecord


def step(
    index: int, chunks: list[tuple[str, int, int]], batch: int = 1, preempted=()
) -> StepRecord:
    """Step `index` runs from t = index to index + 0.5 (seconds)."""
    records = [ScheduledChunk(*c) for c in chunks]
    num_tokens = sum(c.num_tokens for c in records)
    return StepRecord(index, float(index), index + 0.5, batch, num_tokens, records, list(preempted))


def kinds(timelines: RequestTimelines, api_id: str, index: int = 0) -> list[str]:
    timeline = timelines.as_json(api_id)
    assert timeline is not None
    return [e["type"] for e in timeline["requests"][index]["events"]]


def test_chunked_prefill_then_decode_runs_merged_by_batch_size() -> None:
    timelines = RequestTimelines()
    timelines.add("cmpl-1", "cmpl-1-0", 40, arrival_time=0.0, queued_time=0.25)
    timelines.on_step(step(1, [("cmpl-1-0", 16, 16)], batch=1))  # 16 cached at admission
    timelines.on_step(step(2, [("cmpl-1-0", 32, 8)], batch=2))
    for index, batch in [(3, 2), (4, 2), (5, 3), (7, 3)]:  # step 6 ran without it
        timelines.on_step(step(index, [("cmpl-1-0", 40 + index - 3, 1)], batch=batch))
    timelines.on_finished("cmpl-1-0", "length", 8.0)
    body = timelines.as_json("cmpl-1")
    assert body is not None and body["is_finished"]
    (request,) = body["requests"]
    events = request["events"]
    assert [e["type"] for e in events] == [
        "arrived",
        "queued",
        "admitted",
        "prefill",
        "prefill",
        "decode",
        "decode",
        "decode",
        "finished",
    ]
    assert events[1]["t"] == 0.25 and events[2] == {
        "type": "admitted",
        "t": 1.0,
        "cached_tokens": 16,
    }
    assert [(e["first_position"], e["num_tokens"]) for e in events[3:5]] == [(16, 16), (32, 8)]
    decodes = [(e["num_steps"], e["batch_size"], e["num_tokens"]) for e in events[5:8]]
    assert decodes == [(2, 2, 2), (1, 3, 1), (1, 3, 1)]  # a gap or a new batch size: new run
    assert (events[5]["start"], events[5]["end"]) == (3.0, 4.5)
    assert events[-1] == {"type": "finished", "t": 8.0, "reason": "length"}
    assert request["num_output_tokens"] == 4


def test_a_preempted_request_waits_then_is_recomputed_from_its_cached_prefix() -> None:
    timelines = RequestTimelines()
    timelines.add("a", "a-0", 20, 0.0, 0.0)
    timelines.on_step(step(1, [("a-0", 0, 20)]))
    timelines.on_step(step(2, [("a-0", 20, 1)]))
    timelines.on_step(step(3, [("a-0", 21, 1)]))
    timelines.on_step(step(4, [], batch=1, preempted=["a-0"]))
    timelines.on_step(step(6, [("a-0", 16, 7)]))  # readmitted: one block cached, 7 to run
    timelines.on_step(step(7, [("a-0", 23, 1)]))
    timelines.on_finished("a-0", "stop", 8.0)
    assert kinds(timelines, "a") == [
        "arrived",
        "queued",
        "admitted",
        "prefill",
        "decode",
        "preempted",
        "admitted",
        "recompute",
        "decode",
        "finished",
    ]
    events = timelines.as_json("a")["requests"][0]["events"]  # type: ignore[index]
    assert events[5] == {"type": "preempted", "t": 4.5}
    assert events[6]["cached_tokens"] == 16
    assert (events[7]["first_position"], events[7]["num_tokens"]) == (16, 7)
    assert timelines.as_json("a")["requests"][0]["num_preemptions"] == 1  # type: ignore[index]


def test_only_the_last_max_requests_are_kept() -> None:
    timelines = RequestTimelines(max_requests=3)
    for i in range(5):
        timelines.add(f"r{i}", f"r{i}-0", 4, 0.0, 0.0)
        timelines.add(f"r{i}", f"r{i}-1", 4, 0.0, 0.0)  # n = 2: one group, two lanes
    assert [timelines.as_json(f"r{i}") is None for i in range(5)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert not timelines.is_recording("r0-0") and timelines.is_recording("r4-1")
    timelines.on_step(step(1, [("r0-0", 0, 4)]))  # an evicted request's step is ignored
    assert timelines.as_json("r0") is None
    assert len(timelines.as_json("r4")["requests"]) == 2  # type: ignore[index]


def test_events_are_cut_at_max_events_but_the_end_is_kept() -> None:
    timelines = RequestTimelines(max_events=6)
    timelines.add("a", "a-0", 4, 0.0, 0.0)
    timelines.on_step(step(1, [("a-0", 0, 4)]))
    for index in range(2, 40):  # alternating batch sizes: no two decode steps merge
        timelines.on_step(step(index, [("a-0", 2 + index, 1)], batch=1 + index % 2))
    timelines.on_finished("a-0", "length", 50.0)
    request = timelines.as_json("a")["requests"][0]  # type: ignore[index]
    assert len(request["events"]) == 7  # 6, then the end
    assert request["events"][-1]["type"] == "finished"
    assert request["num_events_dropped"] == 38 - 2
    assert request["num_output_tokens"] == 38  # counted even when not kept


def test_an_abort_ends_the_timeline_and_later_steps_are_ignored() -> None:
    timelines = RequestTimelines()
    timelines.add("a", "a-0", 4, 0.0, 0.0)
    timelines.on_finished("a-0", "abort", 0.5)
    timelines.on_step(step(1, [("a-0", 0, 4)]))
    assert kinds(timelines, "a") == ["arrived", "queued", "finished"]


@pytest.mark.parametrize("bad", [{"max_requests": 0}, {"max_events": 3}])
def test_its_bounds_must_be_positive(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be ≥"):
        RequestTimelines(**bad)
