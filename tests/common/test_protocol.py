"""Every message between front and worker survives an encode/decode round trip unchanged."""

from __future__ import annotations

import msgspec
import pytest

from nanoserve.common.protocol import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FinishReason,
    Heartbeat,
    Ready,
    RequestDelta,
    RequestFailed,
    Shutdown,
    StepOutputs,
    ToFront,
    TokenLogprobs,
    ToWorker,
    WorkerFailed,
    front_codec,
    worker_codec,
)
from nanoserve.common.sampling_params import SamplingParams

TO_WORKER = [
    AddRequest(
        "cmpl-1-0",
        [1, 2, 3],
        SamplingParams(
            temperature=0.7,
            top_k=5,
            seed=3,
            stop=["\n", "END"],
            stop_token_ids=[7],
            logit_bias={5: -100.0, 9: 2.5},
            logprobs=2,
            prompt_logprobs=1,
            max_tokens=None,
        ),
        123.5,
    ),
    AddRequest("x", [0], SamplingParams(), 0.0),
    AbortRequests(["a", "b"]),
    AbortRequests([]),
    Shutdown(),
]
TO_FRONT = [
    Ready(
        pid=42,
        max_model_len=1024,
        vocab_size=320,
        num_kv_blocks=100,
        block_size=16,
        load_time_s=1.5,
        kv_sizing_time_s=0.1,
        warmup_time_s=0.2,
    ),
    StepOutputs(
        deltas=[
            RequestDelta("a", [5], None, None, None, 3, 0),
            RequestDelta(
                "b",
                [6, 7],
                [TokenLogprobs(6, -0.5, 1, [6, 8], [-0.5, -1.0]), TokenLogprobs(7, -2, 3, [], [])],
                int(FinishReason.STOP),
                7,
                10,
                8,
                [TokenLogprobs(9, -1.25, 2, [3], [-0.75])],  # prompt_logprobs
            ),
        ],
        stats=EngineStats(num_running=2, kv_cache_usage=0.25, num_preemptions_total=1),
    ),
    StepOutputs(deltas=[], stats=EngineStats()),
    RequestFailed("a", "prompt too long"),
    WorkerFailed("RuntimeError: boom", "Traceback ..."),
    Heartbeat(),
    WorkerFailed("kv_cache_memory is too small", "", is_config_error=True),
]


@pytest.mark.parametrize("message", TO_WORKER, ids=lambda m: type(m).__name__)
def test_to_worker_round_trip(message: msgspec.Struct) -> None:
    assert worker_codec().decode(front_codec().encode(message)) == message


@pytest.mark.parametrize("message", TO_FRONT, ids=lambda m: type(m).__name__)
def test_to_front_round_trip(message: msgspec.Struct) -> None:
    assert front_codec().decode(worker_codec().encode(message)) == message


def test_sampling_params_are_validated_on_decode() -> None:
    raw = msgspec.msgpack.encode(AddRequest("a", [1], SamplingParams(), 0.0))
    bad = raw.replace(msgspec.msgpack.encode(1.0), msgspec.msgpack.encode(-1.0), 1)  # temperature
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(bad, type=ToWorker)


def test_directions_do_not_mix() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(Shutdown()), type=ToFront)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(RequestFailed("a", "b")), type=ToWorker)
