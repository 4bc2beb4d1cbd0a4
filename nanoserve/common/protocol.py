"""The wire between the front and the worker: every message, as msgspec structs (torch-free).

One tagged union per direction. The front sends `ToWorker`; the worker answers `ToFront`.
Token ids cross the boundary, never text or tensors, and never pickle. Both processes import
this module; it imports nothing from `nanoserve.core`, so the front never loads torch's model
code to speak to the worker.
"""

from __future__ import annotations

import enum

import msgspec

from nanoserve.common.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request stopped. `STOP` covers EOS, stop token ids and stop strings."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probability of one sampled token and of the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestDelta(msgspec.Struct, array_like=True):
    """New tokens of one request from one step; `finish_reason` is set on its last delta."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    queue_time_s: float | None = None  # arrival to first scheduled; set on the first delta only
    # With `prompt_logprobs` asked for, on the first delta only: position j's logprobs of prompt
    # token j + 1, for j in [0, num_prompt_tokens - 1) (the first token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Why the engine could not run the request (e.g. its grammar did not compile), with
    # finish_reason ABORT: the front answers a 400 with this message, not an empty completion.
    error: str | None = None


class SpecDecodeStats(msgspec.Struct):
    """Speculative decoding's running totals (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # requests' verify steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_position: list[int] = msgspec.field(default_factory=list)  # [k]


class EngineStats(msgspec.Struct):
    """Gauges and counters the metrics endpoint shows."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use by requests
    num_kv_blocks: int = 0
    block_size: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    spec_decode: SpecDecodeStats | None = None  # None without speculative decoding


# ---- front -> worker ----


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Start generating for one (already fanned-out, n == 1) request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() in the front; the clock is shared on one machine
    record_timeline: bool = False  # the worker describes each step that runs it (StepRecord)


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
    kv_sizing_time_s: float  # sizing and allocating the KV pool, building the step runners
    warmup_time_s: float
    prepare_time_s: float = 0.0  # installing linear methods and layer ops (packing weights)
    imports_time_s: float = 0.0  # a worker process's imports of torch and the engine
    setup_time_s: float = 0.0  # a worker process's fast paths (CPU kernels), parallel group
    kv_cache_dtype: str = "auto"  # as --kv-cache-dtype chose: auto (the model's), fp8, ...


class ScheduledChunk(msgspec.Struct, array_like=True):
    """What one step ran of one request: tokens [num_computed_tokens, + num_tokens).

    On the step that admits a request, `num_computed_tokens` is its prefix-cache hit.
    """

    request_id: str
    num_computed_tokens: int  # in the KV cache before the step
    num_tokens: int  # run in this step (a prompt chunk, a recompute, or decode tokens)


class StepRecord(msgspec.Struct, array_like=True):
    """One engine step as a request timeline sees it (only for requests that asked for one)."""

    step_index: int  # counted by the engine loop since it started
    start_time: float  # time.monotonic() in the worker, as AddRequest.arrival_time
    end_time: float
    num_requests: int  # the batch: every request the step ran
    num_batched_tokens: int  # tokens the whole batch ran
    chunks: list[ScheduledChunk]  # the recorded requests that ran
    preempted_ids: list[str]  # the recorded requests this step preempted


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """What one engine step produced: a delta per request that advanced, and fresh stats."""

    deltas: list[RequestDelta]
    stats: EngineStats
    step: StepRecord | None = None  # when a request in the step records its timeline


class RequestFailed(msgspec.Struct, tag="request_failed", array_like=True):
    """The engine refused one request (e.g. add_request raised); the worker is fine."""

    request_id: str
    message: str


class WorkerFailed(msgspec.Struct, tag="failed", array_like=True):
    """The worker hit an error it cannot recover from and is about to exit."""

    message: str
    traceback: str
    is_config_error: bool = False  # a bad setting or checkpoint (ValueError), not a bug


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """The worker process is alive: sent at a fixed interval by a thread beside its loop."""


# The front restarts a worker it has not heard from (a heartbeat or any other message) for this
# long; the worker beats several times per timeout (at most once a second).
DEFAULT_WORKER_TIMEOUT_S = 30.0
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0


ToFront = Ready | StepOutputs | RequestFailed | WorkerFailed | Heartbeat


class WorkerAddresses(msgspec.Struct, frozen=True):
    """Where the worker reads requests from and writes outputs to (`ipc://` or `tcp://`).

    The front binds both sockets, the worker connects to them.
    """

    to_worker: str
    to_front: str


class Codec:
    """msgpack encoder/decoder for one direction's union (reusable buffers)."""

    def __init__(self, decode_type: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> msgspec.Struct:
        return self._decoder.decode(data)


def worker_codec() -> Codec:
    """The worker's codec: decodes ToWorker."""
    return Codec(ToWorker)


def front_codec() -> Codec:
    """The front's codec: decodes ToFront."""
    return Codec(ToFront)
