"""What one engine step reports: per request that advanced, only what is new.

These are msgspec structs so that the worker can send them to the front as they are.
"""

from __future__ import annotations

import msgspec


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
    finish_reason: int | None = None  # a FinishReason value
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    queue_time_s: float | None = None  # arrival to first scheduled; set on the first delta only


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
