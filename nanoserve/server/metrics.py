"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged.

A private registry (not the process-global one) keeps servers in one process, e.g. in tests,
from sharing counters. Engine gauges and counters come from the worker's `EngineStats`; request
latencies are measured in the front.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoserve.common.protocol import EngineStats

# Metrics the worker's EngineStats feed: one series per data-parallel engine, as vLLM labels them.
ENGINE_LABELS = ["model_name", "engine"]

# Fine steps between 50 and 300 ms, where autocomplete users feel the difference.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2),
    *(0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
ITL_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2),
    *(0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
)
REQUEST_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """All metrics of one server, labelled with its model name; those the engines report also
    with the engine's index (`engine="0"`, `"1"`, ... with --data-parallel-size)."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._add_engine_metrics()
        self._add_request_metrics()
        self._last_stats = [EngineStats() for _ in range(num_engines)]
        for engine in range(num_engines):  # every engine's series exists from the start
            self.update_engine_stats(EngineStats(), engine)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self._model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self._model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        metric = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
        return metric.labels(self._model_name)

    def _add_engine_metrics(self) -> None:
        """Gauges and counters that mirror each engine's `EngineStats`."""

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ENGINE_LABELS, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ENGINE_LABELS, registry=self.registry)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."
        )
        self.num_preemptions = counter("vllm:num_preemptions", "Preempted requests.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )

    def _add_request_metrics(self) -> None:
        """Token counts, outcomes and latencies, measured in the front per request."""
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(self._model_name, reason)  # export zeros from the start
        self.http_requests_client_disconnected = self._counter(
            "vllm:http_requests_client_disconnected",
            "Requests whose client closed the connection before the response was complete.",
        )
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e_request_latency = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            REQUEST_BUCKETS,
        )
        self.request_queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited before it was scheduled.",
            REQUEST_BUCKETS,
        )

    def update_engine_stats(self, stats: EngineStats, engine: int = 0) -> None:
        """Set engine `engine`'s gauges; advance the counters it keeps as running totals."""
        labels = (self._model_name, str(engine))
        self.num_requests_running.labels(*labels).set(stats.num_running)
        self.num_requests_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(*labels).set(stats.kv_cache_usage)
        last = self._last_stats[engine]
        for counter, new, old in (
            (self.num_preemptions, stats.num_preemptions_total, last.num_preemptions_total),
            (self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
        ):
            # A restarted worker counts from zero again: then all of `new` is new.
            counter.labels(*labels).inc(new - old if new >= old else new)
        self._last_stats[engine] = stats

    def observe_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self._model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
