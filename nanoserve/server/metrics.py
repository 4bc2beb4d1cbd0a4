"""Prometheus metrics under vLLM's names, labels and buckets, so vLLM's dashboards work unchanged.

The set is vLLM v1's (`vllm/v1/metrics/loggers.py`, PrometheusStatLogger) wherever its meaning
fits this server; every series carries `model_name` and the data-parallel `engine` ("0", "1",
...). A private registry (not the process-global one) keeps servers in one process, e.g. in
tests, from sharing counters. Engine gauges and counters come from the worker's `EngineStats`;
per-request times and token counts are measured in the front (`RequestTimes`), from the time
each delta reaches it, as vLLM's front process measures them from its engine's timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoserve.common.protocol import EngineStats, Ready, SpecDecodeStats

ENGINE_LABELS = ["model_name", "engine"]

# vLLM's buckets, so that `sum by (le)` holds across a fleet that mixes vLLM and nanoserve.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0),
)
REQUEST_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0),
    *(240.0, 480.0, 960.0, 1920.0, 7680.0),
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # nanoserve never sleeps
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class RequestTimes:
    """One engine request as the metrics see it: where it runs, its sizes, and the front's
    monotonic times of its arrival, first scheduling, first and last delta."""

    engine: int
    num_prompt_tokens: int
    n: int  # the API request's n
    max_tokens: int | None
    arrival_time: float
    scheduled_time: float | None = None  # arrival + the engine's queue time, once known
    first_delta_time: float | None = None  # the prefill is done (first token, or none asked)
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class ServerMetrics:
    """All metrics of one server, each labelled with its model name and engine index."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._engines = [str(engine) for engine in range(num_engines)]
        self._add_engine_metrics()
        self._add_token_metrics()
        self._add_latency_metrics()
        self._lengths: dict[str, Histogram] | None = None  # once max_model_len is known
        self._last_stats = [EngineStats() for _ in range(num_engines)]
        for engine in range(num_engines):  # every engine's series exists from the start
            self.update_engine_stats(EngineStats(), engine)

    def _metric(
        self,
        kind: type,
        name: str,
        doc: str,
        extra_labels: tuple[str, ...] = (),
        buckets: tuple[float, ...] | None = None,
    ) -> Any:
        """A metric labelled (model_name, engine, *extra_labels); without extra labels, each
        engine's series is made now (so it is exported, at zero, from the start)."""
        labels = [*ENGINE_LABELS, *extra_labels]
        options = {} if buckets is None else {"buckets": buckets}
        metric = kind(name, doc, labels, registry=self.registry, **options)
        if not extra_labels:
            for engine in self._engines:
                metric.labels(self._model_name, engine)
        return metric

    def _add_engine_metrics(self) -> None:
        """Gauges and counters that mirror each engine's `EngineStats`."""
        self.num_requests_running = self._metric(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = self._metric(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = self._metric(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.gpu_cache_usage_perc = self._metric(  # vLLM's example dashboard still reads it
            Gauge,
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc.",
        )
        self.num_preemptions = self._metric(
            Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_cache_queries = self._metric(
            Counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = self._metric(
            Counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self.iteration_tokens = self._metric(
            Histogram,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets=ITERATION_TOKEN_BUCKETS,
        )
        self._add_spec_decode_metrics()
        sleep_state = self._metric(
            Gauge,
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 1 means engine is awake (nanoserve has no sleep mode).",
            extra_labels=("sleep_state",),
        )
        for engine in self._engines:
            for state in SLEEP_STATES:
                sleep_state.labels(self._model_name, engine, state).set(state == "awake")
        self.cache_config_info: Gauge | None = None  # labelled with the first Ready's values

    def _add_spec_decode_metrics(self) -> None:
        """vLLM's speculative-decoding counters (they stay at 0 without speculation)."""
        self.spec_num_drafts = self._metric(
            Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
        )
        self.spec_num_draft_tokens = self._metric(
            Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_num_accepted_tokens = self._metric(
            Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.spec_accepted_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labelnames=("model_name", "engine", "position"),
            registry=self.registry,
        )

    def _update_spec_decode(
        self, new: SpecDecodeStats | None, old: SpecDecodeStats | None, labels
    ) -> None:
        if new is None:
            return
        old = old or SpecDecodeStats()
        for counter, now, before in (
            (self.spec_num_drafts, new.num_drafts, old.num_drafts),
            (self.spec_num_draft_tokens, new.num_draft_tokens, old.num_draft_tokens),
            (self.spec_num_accepted_tokens, new.num_accepted_tokens, old.num_accepted_tokens),
        ):
            counter.labels(*labels).inc(now - before if now >= before else now)
        previous = old.num_accepted_per_position
        for position, now in enumerate(new.num_accepted_per_position):
            before = previous[position] if position < len(previous) else 0
            counter = self.spec_accepted_per_position.labels(*labels, str(position))
            counter.inc(now - before if now >= before else now)

    def _add_token_metrics(self) -> None:
        """Token counts and outcomes, counted in the front per engine request."""
        self.prompt_tokens = self._metric(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.prompt_tokens_by_source = self._metric(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            extra_labels=("source",),
        )
        self.prompt_tokens_cached = self._metric(
            Counter, "vllm:prompt_tokens_cached", "Number of cached prompt tokens."
        )
        self.generation_tokens = self._metric(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = self._metric(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            extra_labels=("finished_reason",),
        )
        for engine in self._engines:  # export zeros from the start
            for reason in FINISH_REASONS:
                self.request_success.labels(self._model_name, engine, reason)
            for source in PROMPT_SOURCES:
                self.prompt_tokens_by_source.labels(self._model_name, engine, source)
        self.request_params_n = self._metric(
            Histogram,
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            buckets=N_BUCKETS,
        )
        self.http_requests_client_disconnected = Counter(  # nanoserve's own: no engine label
            "vllm:http_requests_client_disconnected",
            "Requests whose client closed the connection before the response was complete.",
            ["model_name"],
            registry=self.registry,
        ).labels(self._model_name)

    def _add_latency_metrics(self) -> None:
        """Per-token and per-request times, measured in the front."""

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return self._metric(Histogram, name, doc, buckets=buckets)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.time_per_output_token = histogram(  # vLLM's example dashboard still reads it
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: use vllm:inter_token_latency_seconds.",
            ITL_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.phases = {
            phase: histogram(f"vllm:{name}_seconds", doc, REQUEST_BUCKETS)
            for phase, name, doc in (
                ("e2e", "e2e_request_latency", "Histogram of e2e request latency in seconds."),
                ("queue", "request_queue_time", "Histogram of time spent in WAITING phase."),
                ("inference", "request_inference_time", "Histogram of time in RUNNING phase."),
                ("prefill", "request_prefill_time", "Histogram of time in PREFILL phase."),
                ("decode", "request_decode_time", "Histogram of time in DECODE phase."),
            )
        }

    def engine_ready(self, info: Ready) -> None:
        """The context length and KV pool are known: the token-count histograms (buckets up to
        max_model_len, as vLLM's) and vllm:cache_config_info, made once."""
        if self._lengths is not None:
            return

        def histogram(name: str, doc: str) -> Histogram:
            buckets = build_1_2_5_buckets(info.max_model_len)
            return self._metric(Histogram, f"vllm:{name}", doc, buckets=buckets)

        self._lengths = {
            "prompt": histogram("request_prompt_tokens", "Number of prefill tokens processed."),
            "generation": histogram(
                "request_generation_tokens", "Number of generation tokens processed."
            ),
            "max_generation": histogram(
                "request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
            ),
            "max_tokens": histogram(
                "request_params_max_tokens", "Histogram of the max_tokens request parameter."
            ),
            "prefill_kv": histogram(
                "request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            ),
        }
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "cache_dtype", "engine"],
            registry=self.registry,
        )
        for engine in self._engines:
            self.cache_config_info.labels(
                str(info.block_size), str(info.num_kv_blocks), info.kv_cache_dtype, engine
            ).set(1)

    def update_engine_stats(self, stats: EngineStats, engine: int = 0) -> None:
        """Set engine `engine`'s gauges; advance the counters it keeps as running totals."""
        labels = (self._model_name, str(engine))
        self.num_requests_running.labels(*labels).set(stats.num_running)
        self.num_requests_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(*labels).set(stats.kv_cache_usage)
        self.gpu_cache_usage_perc.labels(*labels).set(stats.kv_cache_usage)
        last = self._last_stats[engine]
        for counter, new, old in (
            (self.num_preemptions, stats.num_preemptions_total, last.num_preemptions_total),
            (self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
        ):
            # A restarted worker counts from zero again: then all of `new` is new.
            counter.labels(*labels).inc(new - old if new >= old else new)
        self._update_spec_decode(stats.spec_decode, last.spec_decode, labels)
        self._last_stats[engine] = stats

    def observe_step(self, num_tokens: int, engine: int = 0) -> None:
        """One engine step's tokens: those generated, and the prompts whose prefill it ended."""
        self.iteration_tokens.labels(self._model_name, str(engine)).observe(num_tokens)

    def observe_delta(
        self,
        times: RequestTimes,
        num_new_tokens: int,
        now: float,
        queue_time_s: float | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        """A delta of `times`' request reached the front at `now` with `num_new_tokens`."""
        labels = (self._model_name, str(times.engine))
        if queue_time_s is not None and times.scheduled_time is None:
            times.scheduled_time = times.arrival_time + queue_time_s
        if times.first_delta_time is None:
            times.first_delta_time = now
            self._observe_prefill_done(times, num_cached_tokens)
        if not num_new_tokens:
            return
        if times.last_token_time is None:
            self.time_to_first_token.labels(*labels).observe(now - times.arrival_time)
        else:
            latency = (now - times.last_token_time) / num_new_tokens
            for _ in range(num_new_tokens):
                self.inter_token_latency.labels(*labels).observe(latency)
                self.time_per_output_token.labels(*labels).observe(latency)
        times.last_token_time = now
        times.num_generation_tokens += num_new_tokens
        self.generation_tokens.labels(*labels).inc(num_new_tokens)

    def _observe_prefill_done(self, times: RequestTimes, num_cached_tokens: int) -> None:
        labels = (self._model_name, str(times.engine))
        num_cached = min(num_cached_tokens, times.num_prompt_tokens)
        self.prompt_tokens.labels(*labels).inc(times.num_prompt_tokens)
        self.prompt_tokens_cached.labels(*labels).inc(num_cached)
        for source, count in (
            ("local_compute", times.num_prompt_tokens - num_cached),
            ("local_cache_hit", num_cached),
        ):
            self.prompt_tokens_by_source.labels(*labels, source).inc(count)
        self.request_params_n.labels(*labels).observe(times.n)
        if self._lengths is not None:
            self._lengths["prefill_kv"].labels(*labels).observe(
                times.num_prompt_tokens - num_cached
            )
            if times.max_tokens:
                self._lengths["max_generation"].labels(*labels).observe(times.max_tokens)

    def observe_finished(self, times: RequestTimes, finish_reason: str, now: float) -> None:
        """`times`' request ended at `now` (`abort`: the front stopped it): its outcome, its
        phases (vLLM's: queue, prefill, decode, inference = prefill + decode, e2e) and sizes."""
        labels = (self._model_name, str(times.engine))
        self.request_success.labels(*labels, finish_reason).inc()
        scheduled = times.scheduled_time
        first = times.first_delta_time
        last = times.last_token_time if times.last_token_time is not None else first
        phases = {
            "e2e": now - times.arrival_time,
            "queue": (scheduled if scheduled is not None else now) - times.arrival_time,
            "prefill": first - scheduled if first is not None and scheduled is not None else 0.0,
            "decode": last - first if last is not None and first is not None else 0.0,
            "inference": last - scheduled if last is not None and scheduled is not None else 0.0,
        }
        for phase, seconds in phases.items():
            self.phases[phase].labels(*labels).observe(max(seconds, 0.0))
        num_generated = times.num_generation_tokens
        per_token = phases["decode"] / (num_generated - 1) if num_generated > 1 else 0.0
        self.request_time_per_output_token.labels(*labels).observe(per_token)
        if self._lengths is not None:
            self._lengths["prompt"].labels(*labels).observe(times.num_prompt_tokens)
            self._lengths["generation"].labels(*labels).observe(num_generated)
            if times.max_tokens:
                self._lengths["max_tokens"].labels(*labels).observe(times.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
