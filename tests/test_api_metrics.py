"""GET /metrics on the API port (engine/entrypoints/api_metrics.py), in this process: the
frontend over a scripted engine client, the sidecar a real metrics HTTP server
(telemetry/sidecar/metrics_http.py)."""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints import api_metrics
from engine.entrypoints.frontend import Frontend
from engine.entrypoints.routes import build_app
from engine.entrypoints.serve_args import TINY_MODEL
from telemetry.sidecar.metrics_http import serve_metrics
from telemetry.sidecar.sinks.prometheus import PrometheusSink
from tests.helpers.net import free_port
from tests.helpers.serve import PLAIN_TEMPLATE, ScriptedClient, TemplateTokenizer


@pytest.fixture
def sidecar():
    """A sidecar's /metrics: one vLLM-named gauge (its colon must survive the forwarding)."""
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Running.", ["model_name"], registry=registry).labels(
        "tiny"
    ).set(2)
    server = serve_metrics(registry, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers (a stuck sidecar)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def scripted_frontend(text: str = "ok") -> tuple[Frontend, ScriptedClient]:
    client = ScriptedClient([[byte] for byte in text.encode()])
    return Frontend(client, TemplateTokenizer(PLAIN_TEMPLATE), TINY_MODEL), client


def families(response: httpx.Response) -> dict:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def values(family, sample_name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == sample_name
    }


def test_requests_are_counted_by_route_template_status_class_and_method(sidecar, monkeypatch):
    frontend, client = scripted_frontend()
    http = TestClient(
        build_app(frontend, sidecar_metrics_url=sidecar), raise_server_exceptions=False
    )
    completion = {"prompt": "hi", "max_tokens": 2}
    calls = [  # (method, path, body, the route template it must be counted under)
        *[("POST", "/v1/completions", completion, "/v1/completions")] * 3,
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, "/v1/completions"),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": True},
            "/v1/chat/completions",
        ),
        ("GET", "/v1/models", None, "/v1/models"),
        ("GET", "/v1/completions", None, "/v1/completions"),  # 405
        ("GET", "/v1/nothing/123", None, "none"),  # unknown paths share one series
        ("GET", "/v1/nothing/456", None, "none"),
        ("GET", "/health", None, None),  # probes and scrapes are not counted
        ("GET", "/metrics", None, None),
    ]
    expected = Counter()
    for method, path, body, template in calls:
        response = http.request(method, path, json=body)
        if template is not None:
            expected[(method, f"{response.status_code // 100}xx", template)] += 1
    monkeypatch.setattr(client, "add_request", lambda *args, **kwargs: 1 / 0)
    assert http.post("/v1/completions", json=completion).status_code == 500
    expected[("POST", "5xx", "/v1/completions")] += 1
    assert {key[1] for key in expected} == {"2xx", "4xx", "5xx"}  # the table covers each

    answer = http.get("/metrics")
    assert "_created" not in answer.text  # no undocumented creation-time gauges
    found = families(answer)
    counted = {
        (labels["method"], labels["status"], labels["handler"]): value
        for labels, value in (
            (dict(k), v) for k, v in values(found["http_requests"], "http_requests_total").items()
        )
    }
    assert counted == expected
    per_route = Counter()
    for (method, _, handler), count in expected.items():
        per_route[(("handler", handler), ("method", method))] += count
    assert (
        values(found["http_request_duration_seconds"], "http_request_duration_seconds_count")
        == per_route
    )
    assert values(
        found["http_request_duration_highr_seconds"], "http_request_duration_highr_seconds_count"
    ) == {(): sum(expected.values())}
    assert values(found["vllm:num_requests_running"], "vllm:num_requests_running") == {
        (("model_name", "tiny"),): 2
    }
    assert values(found["iterscope_api_sidecar_reachable"], "iterscope_api_sidecar_reachable") == {
        (): 1
    }


def test_without_the_sidecar_the_http_series_still_come(silent_port, sidecar):
    closed_url = f"http://127.0.0.1:{free_port()}/metrics"  # a port nobody listens on
    for url in (None, closed_url, f"http://127.0.0.1:{silent_port}/metrics"):
        app = FastAPI()
        api_metrics.attach(app, url, timeout_s=0.2)
        app.get("/v1/models")(lambda: {"data": []})
        http = TestClient(app)
        assert http.get("/v1/models").status_code == 200
        found = families(http.get("/metrics"))
        assert values(
            found["iterscope_api_sidecar_reachable"], "iterscope_api_sidecar_reachable"
        ) == {(): 0}, url
        assert values(found["http_requests"], "http_requests_total") == {
            (("handler", "/v1/models"), ("method", "GET"), ("status", "2xx")): 1
        }
        assert "vllm:num_requests_running" not in found
    # A sidecar that comes back is read again.
    current = {"url": closed_url}
    metrics = api_metrics.ApiMetrics(lambda: current["url"])
    assert asyncio.run(metrics.read_sidecar()) is None and metrics.sidecar_error
    current["url"] = sidecar  # as a sidecar restarted on another port reports
    assert b"vllm:num_requests_running" in asyncio.run(metrics.read_sidecar())
    assert metrics.sidecar_error is None


def test_a_stuck_sidecar_does_not_hold_up_generation(silent_port):
    """The scrape waits for the sidecar without blocking the event loop: a completion that
    starts after the scrape finishes before it."""
    frontend, _ = scripted_frontend("some words")
    app = build_app(frontend, sidecar_metrics_url=f"http://127.0.0.1:{silent_port}/metrics")

    async def scrape_and_complete() -> list[str]:
        finished = []
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:

            async def call(name: str, method: str, path: str, **kwargs) -> None:
                response = await http.request(method, path, **kwargs)
                assert response.status_code == 200, name
                finished.append(name)

            scrape = asyncio.create_task(call("scrape", "GET", "/metrics"))
            await asyncio.sleep(0.05)  # the scrape is waiting for the sidecar by now
            await call("completion", "POST", "/v1/completions", json={"prompt": "hi"})
            await scrape
        return finished

    assert asyncio.run(scrape_and_complete()) == ["completion", "scrape"]


def test_where_the_sidecar_metrics_come_from():
    class StartedHere:
        metrics_url = "http://127.0.0.1:9999/metrics"

    def args(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        parser.add_argument("--telemetry-address")
        api_metrics.add_arguments(parser)
        return parser.parse_args(argv)

    started_here = StartedHere()
    locate = api_metrics.sidecar_metrics_url(args(), started_here)
    assert locate() == StartedHere.metrics_url
    started_here.metrics_url = "http://127.0.0.1:9998/metrics"  # restarted on another port
    assert locate() == started_here.metrics_url
    assert api_metrics.sidecar_metrics_url(args(), None) is None
    external = args(
        "--telemetry-address",
        "tcp://10.0.0.2:5557",
        "--sidecar-metrics-url",
        "http://10.0.0.2:9470/metrics",
    )
    assert api_metrics.sidecar_metrics_url(external, None) == "http://10.0.0.2:9470/metrics"
    with pytest.raises(ValueError, match="started elsewhere"):
        api_metrics.sidecar_metrics_url(
            args("--sidecar-metrics-url", "http://x/metrics"), StartedHere()
        )
    with pytest.raises(ValueError, match="http:// or https://"):
        api_metrics.sidecar_metrics_url(
            args("--telemetry-address", "tcp://h:1", "--sidecar-metrics-url", "h:9470"), None
        )


def test_no_metric_family_name_repeats_in_the_api_answer():
    """A real sidecar's exposition (vLLM names too) forwarded with the frontend's series: a
    name twice breaks strict parsers, and Prometheus rejects the scrape when two of them
    end up as one series (the sidecar's labels are empty)."""
    registry = CollectorRegistry()
    PrometheusSink(registry, vllm_compatible_names=True)
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        frontend, _ = scripted_frontend()
        http = TestClient(
            build_app(
                frontend, sidecar_metrics_url=f"http://127.0.0.1:{server.server_port}/metrics"
            )
        )
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).is_success
        response = http.get("/metrics")
    finally:
        server.shutdown()
        server.server_close()
    names = Counter(family.name for family in text_string_to_metric_families(response.text))
    assert "iterscope_sidecar_up" in names and "http_requests" in names
    assert [name for name, count in names.items() if count > 1] == []
    found = families(response)
    assert values(found["iterscope_api_sidecar_reachable"], "iterscope_api_sidecar_reachable") == {
        (): 1
    }
