"""/metrics on the API port: the sidecar's series, then the frontend's own HTTP series.

    scrape --GET /metrics--> API server --GET (async, SIDECAR_TIMEOUT_S)--> sidecar /metrics
                             answer = sidecar's exposition + HTTP series of this process

The sidecar stays the only place that aggregates engine telemetry: the API server forwards its
exposition as it is, without parsing it, and adds the series only it can see, under the names
vLLM's API server exposes (prometheus-fastapi-instrumentator's defaults):

- ``http_requests_total{method,status,handler}``: status by class ("2xx", "4xx", "5xx"),
  handler the route template ("/v1/completions"), "none" for a path no route has, so unknown
  paths cannot multiply series;
- ``http_request_duration_seconds{method,handler}`` (few buckets) and
  ``http_request_duration_highr_seconds`` (no labels, many buckets): from the request's
  arrival to its last byte, streams included;
- ``iterscope_api_sidecar_reachable``: 1 when the answer holds the sidecar's series, 0 when
  there is no sidecar or it did not answer in time (the HTTP series come either way). Not
  ``iterscope_sidecar_up``: that family comes with the sidecar's series, and a name twice in
  one exposition breaks strict parsers (and Prometheus stores both as one series, since the
  sidecar's labels are empty).

Scrapes of /metrics and probes of /health are not counted (as in vLLM). The sidecar is read
with non-blocking I/O, so a scrape never holds up the event loop that streams tokens. The
sidecar started by `serve` is restarted when it dies: each scrape reads the URL of the one
that runs now.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from starlette.routing import Match

logger = logging.getLogger("iterscope.serve")

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # keeps the ':' of vllm: names
SIDECAR_TIMEOUT_S = 2.0
NOT_COUNTED = ("/metrics", "/health")
UNKNOWN_HANDLER = "none"
# A fixed /metrics URL, a function giving the current one, or None (no sidecar).
SidecarUrl = str | Callable[[], str | None] | None
LATENCY_BUCKETS = (0.1, 0.5, 1.0)
# fmt: off
LATENCY_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                         3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)
# fmt: on


class HttpSeries:
    """The frontend's HTTP instruments, in a registry of their own."""

    def __init__(self) -> None:
        # No ``*_created`` series: prometheus_client would add one gauge per counter and
        # histogram, holding when it was made, which nobody queries and the docs do not
        # list. The switch is process-wide; nothing else in the API process uses
        # prometheus_client's instruments (the sidecar's series are text passed through).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "http_requests",
            "HTTP requests by method, status class and route template.",
            ["method", "status", "handler"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "http_request_duration_seconds",
            "HTTP request latency by route template.",
            ["method", "handler"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.duration_highr = Histogram(
            "http_request_duration_highr_seconds",
            "HTTP request latency, all routes.",
            buckets=LATENCY_HIGHR_BUCKETS,
            registry=self.registry,
        )
        self.sidecar_reachable = Gauge(
            "iterscope_api_sidecar_reachable",
            "1 when this answer holds the sidecar's series, 0 when it could not be read.",
            registry=self.registry,
        )

    def observe(self, method: str, handler: str, status: int, seconds: float) -> None:
        self.requests.labels(method, f"{status // 100}xx", handler).inc()
        self.duration.labels(method, handler).observe(seconds)
        self.duration_highr.observe(seconds)


def route_template(routes: list[Any], scope: dict[str, Any]) -> str:
    """The path template of the first route the request's path matches (a wrong method
    matches too: its 405 is counted under the route), else UNKNOWN_HANDLER."""
    for route in routes:
        path = getattr(route, "path", None)
        if path is not None and route.matches(scope)[0] != Match.NONE:
            return path
    return UNKNOWN_HANDLER


class CountRequests:
    """ASGI middleware that counts and times every HTTP request into HttpSeries.

    Plain ASGI rather than BaseHTTPMiddleware, so handlers keep the real ``receive`` channel
    (the disconnect watcher of a generation reads it) and streams pass through untouched. An
    exception that leaves the application is answered 500 by Starlette's outermost middleware,
    so it is counted as 5xx.
    """

    def __init__(self, app: Any, series: HttpSeries, router: Any) -> None:
        self.app = app
        self.series = series
        self.router = router  # read per request: routes are added after the middleware

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handler = route_template(self.router.routes, scope) if scope["type"] == "http" else None
        if handler is None or handler in NOT_COUNTED:
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_noting_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.series.observe(scope["method"], handler, status, time.perf_counter() - start)


class ApiMetrics:
    """What GET /metrics answers: the sidecar's exposition (when it can be read) and then
    the HTTP series.

    ``sidecar_url`` is the sidecar's /metrics URL, or a function giving its current one,
    asked at every scrape: a sidecar restarted on --metrics-port 0 serves on a new port.
    """

    def __init__(self, sidecar_url: SidecarUrl, timeout_s: float = SIDECAR_TIMEOUT_S) -> None:
        self.series = HttpSeries()
        self.locate_sidecar = sidecar_url if callable(sidecar_url) else lambda: sidecar_url
        self.sidecar_url: str | None = None  # the URL read last
        # One client for the process: its connection to the sidecar is kept alive between
        # scrapes. trust_env=False: a proxy from the environment must not carry a loopback call.
        self.client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self.sidecar_error: str | None = None  # the last failure, logged once per change

    async def exposition(self) -> bytes:
        sidecar_text = await self.read_sidecar()
        self.series.sidecar_reachable.set(sidecar_text is not None)
        own_text = generate_latest(self.series.registry)
        if not sidecar_text:
            return own_text
        return sidecar_text + (b"" if sidecar_text.endswith(b"\n") else b"\n") + own_text

    async def read_sidecar(self) -> bytes | None:
        self.sidecar_url = self.locate_sidecar()
        if self.sidecar_url is None:
            return None
        try:
            response = await self.client.get(self.sidecar_url)
            response.raise_for_status()
        except httpx.HTTPError as error:
            self._note_sidecar_error(f"{type(error).__name__}: {error}")
            return None
        self._note_sidecar_error(None)
        return response.content

    def _note_sidecar_error(self, error: str | None) -> None:
        if error is not None and self.sidecar_error is None:
            logger.warning(
                "/metrics without the sidecar's series: %s answered %s", self.sidecar_url, error
            )
        elif error is None and self.sidecar_error is not None:
            logger.info("/metrics has the sidecar's series again (%s)", self.sidecar_url)
        self.sidecar_error = error


def attach(
    app: FastAPI, sidecar_url: SidecarUrl, timeout_s: float = SIDECAR_TIMEOUT_S
) -> ApiMetrics:
    """Count the app's requests and answer GET /metrics on it."""
    metrics = ApiMetrics(sidecar_url, timeout_s)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its INFO is a line per scrape
    app.add_middleware(CountRequests, series=metrics.series, router=app.router)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(await metrics.exposition(), media_type=TEXT_FORMAT)

    return metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sidecar-metrics-url",
        default=None,
        metavar="URL",
        help="with --telemetry-address: the /metrics URL of that sidecar, served again on "
        "this server's /metrics (default: the sidecar started here reports its own)",
    )


def sidecar_metrics_url(args: argparse.Namespace, sidecar: Any) -> SidecarUrl:
    """The sidecar's /metrics URL: given by --sidecar-metrics-url for one started elsewhere,
    None without a sidecar; for the sidecar started here, a function giving the URL of the
    one that runs now (each restart reports its own)."""
    url = args.sidecar_metrics_url
    if url is not None and not args.telemetry_address:
        raise ValueError(
            "--sidecar-metrics-url names the /metrics of a sidecar started "
            "elsewhere (--telemetry-address); the sidecar started here reports "
            "its own"
        )
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"--sidecar-metrics-url must be an http:// or https:// URL, got {url!r}")
    if sidecar is not None:
        return lambda: sidecar.metrics_url
    return url
