"""/metrics on the API port of a live `iterscope serve --vllm-compatible-names`, and vLLM's
dashboard and alert-rule queries over it through a real Prometheus.

The queries are written here from the metric names, in the shapes vLLM's example Grafana
dashboards (examples/.../prometheus_grafana: grafana.json and the Kubernetes fleet dashboard)
and PrometheusRule use: quantiles of rates of _bucket series summed by le (and model_name),
averages as rate(_sum) / rate(_count), heatmaps as increase of _bucket by le, counter rates,
gauges, and the series the rules compare with their thresholds (the threshold left out, so a
quiet test run still returns the series). docs/metrics.md lists what each one reads.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints.serve import TINY_MODEL
from tests.helpers.prom import start_prometheus
from tests.helpers.serve import KV_CACHE_MEMORY, ServerProcess
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.live

MODEL = f'model_name="{TINY_MODEL}"'
WINDOW = "1m"  # stands in for Grafana's $__rate_interval and the rules' [5m]
PROMPT = "A prompt long enough to fill two KV blocks, so the prefix cache is looked up. " * 2
HISTOGRAMS = (
    "e2e_request_latency_seconds",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
)
PHASES = (
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
)
HEATMAPS = ("request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total")


def dashboard_queries() -> list[str]:
    """The query shapes of vLLM's example dashboards, $model_name set to the served model."""
    queries = []
    for name in HISTOGRAMS:
        for quantile in (0.99, 0.95, 0.9, 0.5):
            queries.append(
                f"histogram_quantile({quantile}, sum by (le) "
                f"(rate(vllm:{name}_bucket{{{MODEL}}}[{WINDOW}])))"
            )
        queries.append(
            f"rate(vllm:{name}_sum{{{MODEL}}}[{WINDOW}]) / "
            f"rate(vllm:{name}_count{{{MODEL}}}[{WINDOW}])"
        )
        queries.append(
            f"sum(rate(vllm:{name}_sum{{{MODEL}}}[{WINDOW}])) / "
            f"sum(rate(vllm:{name}_count{{{MODEL}}}[{WINDOW}]))"
        )
    for name in PHASES:
        queries.append(f"rate(vllm:{name}_sum{{{MODEL}}}[{WINDOW}])")
        queries.append(
            f"histogram_quantile(0.95, sum by (le) (rate(vllm:{name}_bucket{{{MODEL}}}[{WINDOW}])))"
        )
    for name in HEATMAPS:
        queries.append(f"sum by (le) (increase(vllm:{name}_bucket{{{MODEL}}}[{WINDOW}]))")
    for name in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "request_success_total",
    ):
        queries.append(f"rate(vllm:{name}{{{MODEL}}}[{WINDOW}])")
        queries.append(f"sum(rate(vllm:{name}{{{MODEL}}}[{WINDOW}]))")
    queries += [
        f"sum by (finished_reason) (increase(vllm:request_success_total{{{MODEL}}}[{WINDOW}]))",
        f"sum by (finished_reason) (rate(vllm:request_success_total{{{MODEL}}}[{WINDOW}]))",
        f"sum(rate(vllm:prefix_cache_hits_total{{{MODEL}}}[{WINDOW}])) / "
        f"sum(rate(vllm:prefix_cache_queries_total{{{MODEL}}}[{WINDOW}]))",
        f"rate(vllm:request_max_num_generation_tokens_sum{{{MODEL}}}[{WINDOW}])",
        f"histogram_quantile(0.99, sum by (le, instance) "
        f"(rate(vllm:e2e_request_latency_seconds_bucket{{{MODEL}}}[{WINDOW}])))",
    ]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        queries += [
            f"vllm:{name}{{{MODEL}}}",
            f"sum(vllm:{name}{{{MODEL}}})",
            f"avg(vllm:{name}{{{MODEL}}})",
        ]
    return queries


def alert_rule_queries() -> list[str]:
    """The series vLLM's PrometheusRule compares with its thresholds."""
    queries = [
        f"histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:{name}_bucket[{WINDOW}])))"
        for name in (
            "e2e_request_latency_seconds",
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
        )
    ]
    # The rule writes le="120"; Prometheus 3 reads every le as a number, Prometheus 2 keeps
    # the exposition's spelling, "120.0" (vLLM's and ours alike).
    return queries + [
        f'increase(vllm:e2e_request_latency_seconds_bucket{{le=~"120(\\\\.0)?"}}[{WINDOW}])',
        f"increase(vllm:e2e_request_latency_seconds_count[{WINDOW}])",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        f"rate(vllm:num_preemptions_total[{WINDOW}])",
        'count(up{job="iterscope"} == 1)',
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(
        tmp_path_factory.mktemp("serve"),
        "--model",
        TINY_MODEL,
        "--kv-cache-memory",
        KV_CACHE_MEMORY,
        "--cpu-threads",
        "1",
        "--vllm-compatible-names",
    )
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


def families(url: str) -> dict:
    """The families of the /metrics page at ``url`` by name, after checking that it is the
    Prometheus text format."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def samples(family, sample_name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == sample_name
    }


def http_requests(found: dict) -> Counter:
    counts = Counter()
    for labels, value in samples(found["http_requests"], "http_requests_total").items():
        labels = dict(labels)
        counts[(labels["method"], labels["status"], labels["handler"])] = value
    return counts


def complete(base_url: str, num: int, max_tokens: int = 8) -> None:
    for _ in range(num):
        response = httpx.post(
            f"{base_url}/v1/completions",
            timeout=60,
            json={
                "model": TINY_MODEL,
                "prompt": PROMPT,
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        assert response.status_code == 200, response.text


def finished_in_sidecar(found: dict) -> float:
    return sum(
        samples(found["iterscope_requests_finished"], "iterscope_requests_finished_total").values()
    )


def test_metrics_on_the_api_port(server):
    api_metrics_url = f"{server.base_url}/metrics"
    before = families(api_metrics_url)
    finished_before = finished_in_sidecar(before)
    complete(server.base_url, 3)
    assert (
        httpx.post(
            f"{server.base_url}/v1/completions", json={"max_tokens": -1}, timeout=10
        ).status_code
        == 400
    )

    def counted() -> dict | None:
        page = families(api_metrics_url)
        return page if finished_in_sidecar(page) >= finished_before + 3 else None

    found = wait_until(counted, 20, "the sidecar's series to count the requests", 0.2)
    counts = http_requests(found) - http_requests(before)
    assert counts == {("POST", "2xx", "/v1/completions"): 3, ("POST", "4xx", "/v1/completions"): 1}
    assert samples(found["iterscope_api_sidecar_reachable"], "iterscope_api_sidecar_reachable") == {
        (): 1
    }
    # The sidecar's series are the sidecar's own exposition, vLLM names included.
    sidecar = families(server.metrics_url)
    for name in (
        "iterscope_requests_finished",
        "vllm:request_success",
        "vllm:e2e_request_latency_seconds",
        "iterscope_iterations",
    ):
        assert found[name].samples == sidecar[name].samples, name
    success = samples(found["vllm:request_success"], "vllm:request_success_total")
    assert sum(success.values()) == finished_in_sidecar(found)
    assert {dict(labels)["model_name"] for labels in success} == {TINY_MODEL}
    assert not [name for name in found if name.startswith("http_") and name in sidecar]


def test_metrics_on_the_api_port_without_a_sidecar(tmp_path):
    server = ServerProcess(
        tmp_path,
        "--model",
        TINY_MODEL,
        "--kv-cache-memory",
        KV_CACHE_MEMORY,
        "--cpu-threads",
        "1",
        "--no-sidecar",
    )
    try:
        complete(server.base_url, 1)
        found = families(f"{server.base_url}/metrics")
        assert samples(
            found["iterscope_api_sidecar_reachable"], "iterscope_api_sidecar_reachable"
        ) == {(): 0}
        assert http_requests(found) == {("POST", "2xx", "/v1/completions"): 1}
        assert not [name for name in found if name.startswith(("vllm:", "iterscope_requests"))]
    finally:
        assert server.stop() == 0, server.log()


def test_vllm_dashboard_and_alert_queries_over_the_api_port(server, tmp_path):
    target = server.base_url.removeprefix("http://")
    prometheus = start_prometheus(tmp_path, [target])
    try:
        prometheus.wait_for_targets()
        for _ in range(4):  # requests spread over several scrapes, so rates see them
            complete(server.base_url, 2)
            time.sleep(0.5)
        pending = set(dashboard_queries() + alert_rule_queries())

        def all_have_data() -> bool:
            pending.difference_update(
                [expr for expr in pending if has_number(prometheus.query(expr))]
            )
            return not pending

        wait_until(
            all_have_data,
            30,
            lambda: f"data in every query; without: {sorted(pending)}",
            interval_s=0.5,
        )

        reasons = prometheus.query(
            f"sum by (finished_reason) (vllm:request_success_total{{{MODEL}}})"
        )
        assert {r["metric"]["finished_reason"] for r in reasons} >= {"stop", "length"}
        # The dashboards' model_name variables.
        assert TINY_MODEL in prometheus.api(
            "label/model_name/values", **{"match[]": '{__name__=~"vllm:.*"}'}
        )
        assert TINY_MODEL in prometheus.api(
            "label/model_name/values", **{"match[]": "vllm:num_requests_running"}
        )
    finally:
        prometheus.stop()


def has_number(result: list[dict]) -> bool:
    return any(float(sample["value"][1]) == float(sample["value"][1]) for sample in result)
