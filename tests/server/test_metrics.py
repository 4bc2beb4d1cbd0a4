"""/metrics serves vLLM's metric set under its names, labels and buckets: every query of vLLM's
Grafana dashboard finds its series, a request's phases and sizes are counted exactly, and
cancelled streams count as finished for `abort`."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import InProcessServer, read_metrics

from nanoserve.common.protocol import Ready
from nanoserve.server.metrics import RequestTimes, ServerMetrics, build_1_2_5_buckets

# The panel queries of vLLM's example dashboard, as written in
# vllm-project/vllm: examples/online_serving/prometheus_grafana/grafana.json
# ($model_name is the dashboard's variable; $__rate_interval Grafana's).
GRAFANA_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]  # fmt: skip

# vLLM v1's PrometheusStatLogger (vllm/v1/metrics/loggers.py) as served here: family -> type.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}
VLLM_REQUEST_LATENCY_BUCKETS = [
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0),
    *(240.0, 480.0, 960.0, 1920.0, 7680.0),
]
LONG_STREAM = {"prompt": "tell me a story", "max_tokens": 900, "ignore_eos": True, "stream": True}


def scrape(url: str) -> dict[str, list]:
    """Every family on /metrics: name -> its samples (name, labels, value)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def families(url: str) -> dict[str, str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", **body}, timeout=120)
    assert response.status_code == 200, response.text
    return {} if body.get("stream") else response.json()


def test_every_grafana_panel_query_finds_its_series(server: InProcessServer) -> None:
    for body in ({"max_tokens": 4}, {"max_tokens": 3, "n": 2}, {"max_tokens": 5, "stream": True}):
        complete(server.url, **body)
    samples = [s for family in scrape(server.url).values() for s in family]
    for query in GRAFANA_QUERIES:
        for name in re.findall(r"vllm:[a-z0-9_:]+", query):
            series = [s for s in samples if s.name == name and s.labels["model_name"] == "tiny"]
            assert series, f"{query!r}: no series {name}"
            if name.endswith(("_count", "_sum", "_total")) and "success" not in name:
                assert sum(s.value for s in series) > 0, f"{query!r}: {name} is 0"


def test_vllm_metric_set_with_its_types_and_labels(server: InProcessServer) -> None:
    complete(server.url, max_tokens=2)
    served = families(server.url)
    assert {name: served.get(name) for name in VLLM_METRICS} == VLLM_METRICS
    by_name = scrape(server.url)
    for name in VLLM_METRICS:
        labels = by_name[name][0].labels
        assert labels.get("engine") == "0", name
        if name != "vllm:cache_config_info":
            assert labels["model_name"] == "tiny", name
    info = by_name["vllm:cache_config_info"][0]
    assert (info.labels["num_gpu_blocks"], info.labels["block_size"], info.value) == (
        "512",
        "16",
        1,
    )
    assert info.labels["cache_dtype"] == "auto"
    sleep = {s.labels["sleep_state"]: s.value for s in by_name["vllm:engine_sleep_state"]}
    assert sleep == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


def bucket_bounds(url: str, name: str) -> list[float]:
    samples = scrape(url)[name]
    return [float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket"][:-1]  # no +Inf


def test_buckets_are_vllms(server: InProcessServer) -> None:
    assert bucket_bounds(server.url, "vllm:request_prefill_time_seconds") == (
        VLLM_REQUEST_LATENCY_BUCKETS
    )
    assert bucket_bounds(server.url, "vllm:e2e_request_latency_seconds") == (
        VLLM_REQUEST_LATENCY_BUCKETS
    )
    assert bucket_bounds(server.url, "vllm:iteration_tokens_total") == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
    ]  # fmt: skip
    assert bucket_bounds(server.url, "vllm:request_params_n") == [1, 2, 5, 10, 20]
    # Token counts: 1, 2, 5, ... up to max_model_len (1024 here).
    assert bucket_bounds(server.url, "vllm:request_prompt_tokens") == [
        1, 2, 5, 10, 20, 50, 100, 200, 500, 1000,
    ]  # fmt: skip
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_a_request_is_counted_in_every_phase_and_size(server: InProcessServer) -> None:
    before = read_metrics(server.url)
    # Phases are timed as deltas reach the front, and a stream merges the deltas it has not
    # handed on yet: replies long enough that each choice's tokens come in more than one.
    # A prompt no earlier test sent, so that no kept tail holds any of it.
    usage = complete(server.url, prompt="Zq", max_tokens=40, ignore_eos=True, n=2)["usage"]
    after = read_metrics(server.url)

    def added(key: str) -> float:
        return after[key] - before[key]

    num_prompt = usage["prompt_tokens"]  # a prompt of n = 2 counts once per choice
    for phase in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert added(f"vllm:request_{phase}_seconds_count") == 2
    assert added("vllm:request_decode_time_seconds_sum") > 0
    assert added("vllm:request_success_total{finished_reason=length}") == 2
    assert added("vllm:request_prompt_tokens_sum") == 2 * num_prompt
    assert added("vllm:request_generation_tokens_sum") == 80 == usage["completion_tokens"]
    assert added("vllm:request_params_max_tokens_sum") == 80
    assert added("vllm:request_params_n_sum") == 4  # each choice reports its request's n
    assert added("vllm:prompt_tokens_total") == 2 * num_prompt
    # Every token the engine computed for it, each in the step that computed it.
    assert added("vllm:iteration_tokens_total_sum") == 2 * num_prompt + 80
    assert added("vllm:request_time_per_output_token_seconds_count") == 2
    assert added("vllm:time_to_first_token_seconds_count") == 2


def test_cancelled_streams_count_as_aborted(server: InProcessServer) -> None:
    abort = "vllm:request_success_total{finished_reason=abort}"
    disconnected = "vllm:http_requests_client_disconnected_total"
    before = read_metrics(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(4):
            with client.stream(
                "POST", "/v1/completions", json={**LONG_STREAM, "prompt": f"{i}"}
            ) as r:
                next(r.iter_lines())  # the first frame: it runs; then the client leaves
    deadline = time.monotonic() + 60
    while (metrics := read_metrics(server.url))[disconnected] < before[disconnected] + 4:
        assert time.monotonic() < deadline, "the cancelled streams were not noticed"
        time.sleep(0.05)
    assert metrics[disconnected] - before[disconnected] == 4
    assert metrics[abort] - before[abort] == 4
    assert (
        metrics["vllm:e2e_request_latency_seconds_count"]
        - (before["vllm:e2e_request_latency_seconds_count"])
        == 4
    )


@pytest.mark.parametrize(
    "name", ["vllm:request_success_total", "vllm:prompt_tokens_by_source_total"]
)
def test_labelled_counters_start_at_zero_for_every_label(server: InProcessServer, name) -> None:
    samples = [s for s in scrape(server.url)[name.removesuffix("_total")] if s.name == name]
    label = "finished_reason" if "success" in name else "source"
    expected = {"stop", "length", "abort"} if "success" in name else {
        "local_compute", "local_cache_hit", "external_kv_transfer",
    }  # fmt: skip
    assert {s.labels[label] for s in samples} == expected


def test_cache_config_info_names_an_fp8_kv_cache() -> None:
    metrics = ServerMetrics("m")
    metrics.engine_ready(Ready(1, 64, 300, 10, 16, 0.0, 0.0, 0.0, kv_cache_dtype="fp8"))
    info = next(
        s
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name == "vllm:cache_config_info"
    )
    assert (info.labels["cache_dtype"], info.labels["num_gpu_blocks"]) == ("fp8", "10")


def test_request_series_are_labelled_with_the_engine_that_ran_them() -> None:
    metrics = ServerMetrics("m", num_engines=2)
    metrics.engine_ready(Ready(1, 64, 300, 10, 16, 0.0, 0.0, 0.0))
    times = RequestTimes(engine=1, num_prompt_tokens=5, n=1, max_tokens=3, arrival_time=10.0)
    metrics.observe_delta(times, 1, now=10.5, queue_time_s=0.25, num_cached_tokens=2)
    metrics.observe_delta(times, 2, now=11.5)
    metrics.observe_finished(times, "length", now=11.5)
    samples = {
        (s.name, s.labels.get("engine"), s.labels.get("le")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples[("vllm:request_queue_time_seconds_sum", "1", None)] == 0.25
    assert samples[("vllm:request_prefill_time_seconds_sum", "1", None)] == 0.25
    assert samples[("vllm:request_decode_time_seconds_sum", "1", None)] == 1.0
    assert samples[("vllm:request_inference_time_seconds_sum", "1", None)] == 1.25
    assert samples[("vllm:e2e_request_latency_seconds_sum", "1", None)] == 1.5
    assert samples[("vllm:request_time_per_output_token_seconds_sum", "1", None)] == 0.5
    assert samples[("vllm:prompt_tokens_cached_total", "1", None)] == 2
    assert samples[("vllm:request_prefill_kv_computed_tokens_sum", "1", None)] == 3
    assert samples[("vllm:request_generation_tokens_sum", "1", None)] == 3
    assert samples[("vllm:e2e_request_latency_seconds_count", "0", None)] == 0
    assert samples[("vllm:request_prompt_tokens_bucket", "1", "5.0")] == 1  # 1, 2, 5, 10, 20, 50
