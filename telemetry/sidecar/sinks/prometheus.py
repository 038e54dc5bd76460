"""The Prometheus sink: per-engine state updated from records, rendered at scrape time.

    ingest thread                                   HTTP thread (per scrape)
    on_iteration / on_heartbeat / on_dropped ...    MetricsCollector.collect()
      -> EngineMetrics: plain ints, Histogram         -> Gauge/Counter/HistogramMetricFamily
         lists, and the engine's view (gauges)           built fresh from EngineMetrics

Ingest takes no lock and touches no prometheus_client object; a scrape reads the state while
ingest may be writing it, so one scrape can mix two consecutive records (never a torn number:
every value is a single int/float/reference read under the GIL). Counters only ever add the
non-negative counts a record carries, so they stay monotonic when an engine reconnects
(seq and iteration restart at 1) and when a recording is replayed into the sidecar.

This module holds the state and the sink plug-in (add_arguments, build); the families it
keeps are listed in prometheus_families.py, and MetricsCollector, which renders them, is in
prometheus_exposition.py. docs/metrics.md lists every series with the record fields it
comes from.
"""

from __future__ import annotations

import argparse
import logging
import time

from prometheus_client.core import CollectorRegistry

from telemetry.lane.frame_checks import UNDECODABLE_REASONS
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    FINISH_REASONS,
    UNKNOWN_ELAPSED,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
)
from telemetry.sidecar.engine_view import EngineView
from telemetry.sidecar.histogram import Histogram, check_bounds
from telemetry.sidecar.metrics_http import metrics_url, serve_metrics, write_metrics_url
from telemetry.sidecar.sink import REJECTED_REASONS, Sink
from telemetry.sidecar.sinks.prometheus_exposition import MetricsCollector
from telemetry.sidecar.sinks.prometheus_families import COUNTERS, HISTOGRAMS, PREFIX

DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_METRICS_PORT = 9470
log = logging.getLogger(__name__)


class EngineMetrics:
    """What the sink keeps of one engine besides its view (telemetry/sidecar/engine_view.py,
    which the gauges and labels are read from): counters and histograms. Written only by the
    ingest thread."""

    def __init__(self, engine: EngineView, buckets: dict[str, tuple[float, ...]]) -> None:
        self.engine = engine
        for _, attribute in COUNTERS.values():
            setattr(self, attribute, 0)
        self.num_finished_by_reason = dict.fromkeys(FINISH_REASONS, 0)
        self.histograms = {name: Histogram(bounds) for name, bounds in buckets.items()}
        # Bound once: the per-record path then does no lookups by name.
        self._duration, self._tokens, self._prefill_tokens, self._decode_reqs = (
            self.histograms[name] for name in (
                "iteration_duration_seconds", "iteration_tokens", "iteration_context_tokens",
                "iteration_generation_requests",
            )
        )
        self._inter_token = self.histograms["inter_token_latency_seconds"]
        self.heartbeat_received_ns = 0  # sidecar monotonic clock, 0 = none yet
        self.lag_ns: int | None = None

    def apply_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        """Counters and histograms of one record; ``engine`` is its view, before the record."""
        self.engine = engine
        self.num_received += 1
        self.num_iterations += 1
        self.num_prefill_tokens += record.num_prefill_tokens
        self.num_decode_tokens += record.num_decode_tokens
        self.num_preemptions += record.num_preemptions
        self.num_prefix_query_tokens += record.num_prefix_query_tokens
        self.num_prefix_hit_tokens += record.num_prefix_hit_tokens
        if record.num_waiting_kv_reqs:
            self.num_kv_blocked_iterations += 1
        self.observe_iteration(record, engine.last_record)
        if record.milestones:
            for milestone in record.milestones:
                self.apply_milestone(milestone)

    def observe_iteration(self, record: IterationRecord,
                          previous: IterationRecord | None) -> None:
        """The per-iteration histograms. The inter-token interval is measured only between
        two consecutive iterations of one engine process (``previous``: the record before,
        None after a restart); a gap (drop, restart, replay) is no interval. Weighted: one
        observation per generated token."""
        if not record.unknown & UNKNOWN_ELAPSED:  # a source without iteration times
            self._duration.observe(record.elapsed_ns / 1e9)
        num_prefill_tokens = record.num_prefill_tokens
        num_decode_reqs = record.num_decode_reqs
        self._tokens.observe_count(num_prefill_tokens + record.num_decode_tokens)
        self._prefill_tokens.observe_count(num_prefill_tokens)
        self._decode_reqs.observe_count(num_decode_reqs)
        if (num_decode_reqs and previous is not None
                and record.iteration == previous.iteration + 1):
            end_ns = record.start_ns + record.elapsed_ns
            previous_end_ns = previous.start_ns + previous.elapsed_ns
            if previous_end_ns and end_ns > previous_end_ns:
                self._inter_token.observe((end_ns - previous_end_ns) / 1e9, num_decode_reqs)

    def apply_milestone(self, milestone: RequestMilestone) -> None:
        """TTFT at the first-token event, the rest at the finish (both bits may be set)."""
        histograms = self.histograms
        if milestone.event & EVENT_FIRST_TOKEN:
            histograms["time_to_first_token_seconds"].observe(
                (milestone.first_token_ns - milestone.arrival_ns) / 1e9
            )
            self.num_prompt_tokens_cached += milestone.num_cached_tokens
        if not milestone.event & EVENT_FINISHED:
            return
        reason_index = milestone.finish_reason
        if 0 <= reason_index < len(FINISH_REASONS):
            self.num_finished_by_reason[FINISH_REASONS[reason_index]] += 1
        histograms["e2e_request_latency_seconds"].observe(
            (milestone.finished_ns - milestone.arrival_ns) / 1e9
        )
        histograms["request_prompt_tokens"].observe_count(milestone.num_prompt_tokens)
        histograms["request_generation_tokens"].observe_count(milestone.num_output_tokens)
        histograms["request_preemptions"].observe_count(milestone.num_preemptions)
        if milestone.first_scheduled_ns:  # 0: aborted while waiting
            histograms["request_queue_time_seconds"].observe(
                (milestone.first_scheduled_ns - milestone.arrival_ns) / 1e9
            )
        if milestone.first_token_ns:  # 0: aborted before its first token
            decode_ns = milestone.finished_ns - milestone.first_token_ns
            histograms["request_prefill_time_seconds"].observe(
                (milestone.first_token_ns - milestone.first_scheduled_ns) / 1e9
            )
            histograms["request_decode_time_seconds"].observe(decode_ns / 1e9)
            if milestone.num_output_tokens > 1:
                histograms["time_per_output_token_seconds"].observe(  # ns first: 7.5 ms
                    decode_ns / (milestone.num_output_tokens - 1) / 1e9  # stays le="0.0075"
                )

    def apply_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        """Received and lag: the sidecar's own clocks at receipt (not the ingest clock)."""
        self.engine = engine
        self.num_received += 1
        self.heartbeat_received_ns = time.monotonic_ns()
        self.lag_ns = time.time_ns() - heartbeat.wall_ns


class PrometheusSink(Sink):
    """A Sink (telemetry/sidecar/sink.py) that exposes its engines' state as Prometheus series."""

    name = "prometheus"

    def __init__(
        self,
        registry: CollectorRegistry,
        buckets: dict[str, tuple[float, ...]] | None = None,
        vllm_compatible_names: bool = False,
    ) -> None:
        """``buckets`` overrides default bounds by histogram name (e.g. "iteration_tokens")."""
        self.buckets = {name: bounds for name, (_, bounds) in HISTOGRAMS.items()}
        for name, bounds in (buckets or {}).items():
            if name not in HISTOGRAMS:
                raise ValueError(f"unknown histogram {name!r}; known: {', '.join(HISTOGRAMS)}")
            self.buckets[name] = check_bounds(bounds)
        self.engines: dict[int, EngineMetrics] = {}
        self.num_undecodable = dict.fromkeys(UNDECODABLE_REASONS, 0)
        self.num_rejected = dict.fromkeys(REJECTED_REASONS, 0)
        self.num_lane_disconnects = 0
        self.peers: list = []
        self.collector = MetricsCollector(self, vllm_compatible_names)
        self.registry = registry
        registry.register(self.collector)
        self.port = 0  # bound port once serving
        self.start_time = time.time()
        self._server = None

    def metrics_of(self, engine_index: int) -> EngineMetrics:
        """The engine's metrics; one first met through a loss holds a blank view until its
        first message brings Ingest's."""
        metrics = self.engines.get(engine_index)
        if metrics is None:
            metrics = EngineMetrics(EngineView(engine_index), self.buckets)
            self.engines[engine_index] = metrics
        return metrics

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        metrics = self.engines.get(record.engine_index) or self.metrics_of(record.engine_index)
        metrics.apply_iteration(record, engine)

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        self.metrics_of(heartbeat.engine_index).apply_heartbeat(heartbeat, engine)

    def on_dropped(self, engine_index: int, num_dropped: int) -> None:
        self.metrics_of(engine_index).num_dropped += num_dropped

    def on_engine_conflict(self, engine_index: int, pids: tuple[int, int]) -> None:
        self.metrics_of(engine_index).num_engine_conflicts += 1

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        """Its series leave the next scrape; if the index comes back its counters start
        from 0 again, a reset Prometheus' rate() already takes as a restart."""
        self.engines.pop(engine_index, None)

    def on_undecodable(self, reason: str) -> None:
        self.num_undecodable[reason] = self.num_undecodable.get(reason, 0) + 1

    def on_rejected(self, reason: str) -> None:
        self.num_rejected[reason] = self.num_rejected.get(reason, 0) + 1

    def on_lane_disconnect(self) -> None:
        self.num_lane_disconnects += 1

    def tick(self, now_ns: int) -> None:
        """Nothing to do: every series is rendered at scrape time."""

    def set_peers(self, sinks: list) -> None:
        """The sidecar's sinks (itself included), read at scrape time: their health
        (telemetry/sidecar/sink.py) and, from those that have it, ``sidecar_counters()``."""
        self.peers = list(sinks)

    def serve(self, host: str, port: int) -> int:
        """Serve the registry on http://host:port/metrics in the text format; returns the bound
        port (0 = any)."""
        self._server = serve_metrics(self.registry, host, port)
        self.port = self._server.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def parse_buckets(text: str) -> tuple[str, tuple[float, ...]]:
    """``NAME=B1,B2,...`` -> (name, bounds), for --metrics-buckets."""
    name, sep, values = text.partition("=")
    name = name.strip().removeprefix(PREFIX)
    if not sep or name not in HISTOGRAMS:
        raise argparse.ArgumentTypeError(
            f"expected HISTOGRAM=B1,B2,... with HISTOGRAM one of {', '.join(HISTOGRAMS)};"
            f" got {text!r}"
        )
    try:
        return name, check_bounds(float(value) for value in values.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{name}: {error}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Prometheus /metrics")
    group.add_argument("--metrics-host", default=DEFAULT_METRICS_HOST,
                       help="address to serve /metrics on (default %(default)s)")
    group.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                       help="port to serve /metrics on; 0 picks a free one (default %(default)s)")
    group.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    group.add_argument("--vllm-compatible-names", action="store_true",
                       help="also expose vLLM's series names (vllm:num_requests_running, ...)")
    group.add_argument("--metrics-buckets", type=parse_buckets, action="append", default=[],
                       metavar="HISTOGRAM=B1,B2,...",
                       help="bucket bounds for one histogram (name without iterscope_);"
                            " repeatable")
    # How a process that started this sidecar on --metrics-port 0 learns the port it got.
    group.add_argument("--metrics-url-file", default=None, help=argparse.SUPPRESS)


def build(args: argparse.Namespace) -> PrometheusSink | None:
    """The sink, serving on --metrics-host/--metrics-port, or None with --no-metrics."""
    if args.no_metrics:
        return None
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, dict(args.metrics_buckets), args.vllm_compatible_names)
    port = sink.serve(args.metrics_host, args.metrics_port)
    if args.metrics_url_file:
        write_metrics_url(args.metrics_url_file, metrics_url(args.metrics_host, port))
    return sink
