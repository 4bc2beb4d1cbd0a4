"""Every message between the front and the worker, as msgspec structs (no pickle).

One tagged union per direction. The front sends `ToWorker`; the worker answers `ToFront`.
Token ids cross the boundary, never text or tensors.
"""

from __future__ import annotations

import msgspec

from nanoserve.engine.outputs import EngineStats, RequestDelta
from nanoserve.sampling_params import SamplingParams

# ---- front -> worker ----


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Start generating for one (already fanned-out, n == 1) request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() in the front; the clock is shared on one machine


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests and free their KV blocks; unknown or finished ids are ignored."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish nothing more: exit the worker loop and the process."""


ToWorker = AddRequest | AbortRequests | Shutdown

# ---- worker -> front ----


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The engine is loaded, its KV pool sized and one warm-up generation done."""

    pid: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    load_time_s: float  # reading the weights
    kv_sizing_time_s: float  # measuring memory and allocating the KV pool
    warmup_time_s: float


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """What one engine step produced: a delta per request that advanced, and fresh stats."""

    deltas: list[RequestDelta]
    stats: EngineStats


class RequestFailed(msgspec.Struct, tag="request_failed", array_like=True):
    """The engine refused one request (e.g. add_request raised); the worker is fine."""

    request_id: str
    message: str


class WorkerFailed(msgspec.Struct, tag="failed", array_like=True):
    """The worker hit an error it cannot recover from and is about to exit."""

    message: str
    traceback: str


ToFront = Ready | StepOutputs | RequestFailed | WorkerFailed


class Codec:
    """msgpack encoder/decoder for one direction's union (reusable buffers)."""

    def __init__(self, decode_type: type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        return self._decoder.decode(data)


def worker_codec() -> Codec:
    """The worker's codec: decodes ToWorker."""
    return Codec(ToWorker)


def front_codec() -> Codec:
    """The front's codec: decodes ToFront."""
    return Codec(ToFront)
