"""The Prometheus exposition: metric families built from the sink's state at scrape time.

MetricsCollector follows client_python's custom-Collector pattern: every scrape builds fresh
Gauge/Counter/HistogramMetricFamily objects from the sink's EngineMetrics (per engine) and
its sidecar-level counters and health (counters and histograms in the order of
prometheus_families.py), and with --vllm-compatible-names yields the same samples again under
vLLM's names (VLLM_ALIASES).

It runs on the HTTP thread while the ingest thread may be writing the state, and takes no
lock: one scrape can mix two consecutive records, but never shows a torn number, since every
value is a single int/float/reference read under the GIL. The dicts it walks are copied
(``list(...)``) first, because ingest may add an engine or a reason while it iterates.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from telemetry.lane.record import UNKNOWN_KV_TOKENS, UNKNOWN_WAITING_REASONS, is_known
from telemetry.sidecar.engine_view import kv_usage_ratio
from telemetry.sidecar.sink import EngineStatus, sink_name
from telemetry.sidecar.sinks.prometheus_families import (
    COUNTERS,
    HISTOGRAMS,
    LABELS,
    PREFIX,
    VLLM_ALIASES,
    WAITING_REASONS,
)

if TYPE_CHECKING:  # for the annotations only: the sink module imports this one
    from telemetry.sidecar.sinks.prometheus import EngineMetrics, PrometheusSink

_METRIC_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class MetricsCollector:
    """client_python's custom-Collector pattern: fresh metric families on every scrape."""

    def __init__(self, sink: PrometheusSink, vllm_compatible_names: bool) -> None:
        self.sink = sink
        self.vllm_compatible_names = vllm_compatible_names

    def collect(self) -> Iterator[Metric]:
        engines = [(metrics, [str(index), metrics.engine.model_name])
                   for index, metrics in list(self.sink.engines.items())]
        families = [*self.gauges(engines), *self.counters(engines),
                    *self.histograms(engines), *self.sidecar_counters(),
                    *self.sidecar_health()]
        yield from families
        if self.vllm_compatible_names:
            yield from vllm_aliases(families)

    def gauges(self, engines: list[tuple[EngineMetrics, list[str]]]) -> list[Metric]:
        """From each engine's view (its status None, not judged yet, reads as idle)."""
        now_ns = time.monotonic_ns()
        running = gauge("requests_running", "Requests running (after the last iteration).")
        waiting = gauge("requests_waiting", "Requests waiting (after the last iteration).")
        by_reason = gauge("requests_waiting_by_reason",
                          "Waiting requests by what blocked admission.", ["reason"])
        usage = gauge("kv_cache_usage_ratio", "KV blocks used / total (0..1).")
        used = gauge("kv_blocks_used", "KV-cache blocks in use.")
        free = gauge("kv_blocks_free", "KV-cache blocks free.")
        total = gauge("kv_blocks_capacity", "KV-cache blocks in the pool.")
        kv_tokens = gauge("kv_tokens", "Tokens held in the KV cache.")
        state = gauge("engine_state", "1 for the engine's current state, 0 for the others.",
                      ["state"])
        age = gauge("heartbeat_age_seconds", "Time since the last heartbeat was received.")
        info = gauge("engine_info", "1, with the engine's facts from its heartbeats as labels "
                     "(source: iterscope, vllm-scheduler or vllm-stat-logger).",
                     ["source", "device", "pid"])
        lag = gauge("sidecar_lag_seconds",
                    "Wall time at ingest - wall time the last message was sent.")
        for metrics, labels in engines:
            engine = metrics.engine
            running.add_metric(labels, engine.num_running_reqs)
            waiting.add_metric(labels, engine.num_waiting_reqs)
            record = engine.last_record
            if record is not None and not is_known(record, UNKNOWN_WAITING_REASONS):
                by_reason.add_metric([*labels, "unknown"], record.num_waiting_reqs)
            else:
                for reason, field in WAITING_REASONS:
                    by_reason.add_metric([*labels, reason],
                                         getattr(record, field) if record else 0)
            blocks_used, blocks_total = engine.kv_blocks()
            usage.add_metric(labels, kv_usage_ratio(blocks_used, blocks_total))
            used.add_metric(labels, blocks_used)
            free.add_metric(labels, blocks_total - blocks_used)
            total.add_metric(labels, blocks_total)
            if record is None or is_known(record, UNKNOWN_KV_TOKENS):
                kv_tokens.add_metric(labels, record.num_kv_tokens if record else 0)
            if engine.pid:
                info.add_metric([*labels, engine.source, engine.device_name, str(engine.pid)], 1)
            current = engine.status or EngineStatus.IDLE
            for status in EngineStatus:
                state.add_metric([*labels, status.value], float(current == status))
            if metrics.heartbeat_received_ns:
                age.add_metric(labels, (now_ns - metrics.heartbeat_received_ns) / 1e9)
            if metrics.lag_ns is not None:
                lag.add_metric(labels, metrics.lag_ns / 1e9)
        return [running, waiting, by_reason, usage, used, free, total, kv_tokens, state, age,
                info, lag]

    def counters(self, engines: list[tuple[EngineMetrics, list[str]]]) -> Iterator[Metric]:
        for name, (documentation, attribute) in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, documentation, labels=LABELS)
            for engine, labels in engines:
                family.add_metric(labels, getattr(engine, attribute))
            yield family
        finished = CounterMetricFamily(PREFIX + "requests_finished", "Requests finished.",
                                       labels=[*LABELS, "finish_reason"])
        for engine, labels in engines:
            for reason, count in list(engine.num_finished_by_reason.items()):
                finished.add_metric([*labels, reason], count)
        yield finished
        undecodable = CounterMetricFamily(PREFIX + "frames_undecodable",
                                          "Frames that could not be decoded (unknown sender).",
                                          labels=[*LABELS, "reason"])
        for reason, count in list(self.sink.num_undecodable.items()):
            undecodable.add_metric(["", "", reason], count)
        yield undecodable
        rejected = CounterMetricFamily(
            PREFIX + "frames_rejected",
            "Decoded frames that failed a check and were dropped (see docs/metrics.md).",
            labels=[*LABELS, "reason"])
        for reason, count in list(self.sink.num_rejected.items()):
            rejected.add_metric(["", "", reason], count)
        yield rejected
        disconnects = CounterMetricFamily(
            PREFIX + "lane_disconnects",
            "Lane connections that ended: engines exiting, senders cut off by the size guard.",
            labels=LABELS)
        disconnects.add_metric(["", ""], self.sink.num_lane_disconnects)
        yield disconnects

    def histograms(self, engines: list[tuple[EngineMetrics, list[str]]]) -> Iterator[Metric]:
        for name, (documentation, _) in HISTOGRAMS.items():
            family = HistogramMetricFamily(PREFIX + name, documentation, labels=LABELS)
            for engine, labels in engines:
                buckets, total_sum = engine.histograms[name].cumulative_buckets()
                family.add_metric(labels, buckets, total_sum)
            yield family

    def sidecar_counters(self) -> Iterator[Metric]:
        """Counters of the sidecar itself, from peer sinks (e.g. OTel spans dropped)."""
        values = {"otel_spans_dropped": 0.0}
        for peer in self.sink.peers:
            if not hasattr(peer, "sidecar_counters"):
                continue
            for key, value in peer.sidecar_counters().items():
                name = key.removeprefix(PREFIX).removesuffix("_total")
                if _METRIC_NAME.match(name):
                    values[name] = values.get(name, 0.0) + value
        for name, value in values.items():
            family = CounterMetricFamily(PREFIX + name, f"Sidecar counter {name}.",
                                         labels=LABELS)
            family.add_metric(["", ""], value)
            yield family

    def sidecar_health(self) -> list[Metric]:
        """The sidecar's own up and start time, and each sink's failures and last write."""
        up = gauge("sidecar_up", "1 while the sidecar serves this; absent when it is down.")
        up.add_metric(["", ""], 1.0)
        started = gauge("sidecar_start_time_seconds", "When the sidecar started (unix time).")
        started.add_metric(["", ""], self.sink.start_time)
        errors = CounterMetricFamily(PREFIX + "sink_errors",
                                     "Calls on the sink that raised (ingest went on).",
                                     labels=[*LABELS, "sink"])
        lost = CounterMetricFamily(PREFIX + "sink_lines_lost",
                                   "Messages the sink accepted but gave up writing.",
                                   labels=[*LABELS, "sink"])
        last_write = gauge("sink_last_write_timestamp_seconds",
                           "When the sink last wrote its output successfully (unix time).",
                           ["sink"])
        for peer in self.sink.peers or [self.sink]:
            labels = ["", "", sink_name(peer)]
            errors.add_metric(labels, getattr(peer, "num_errors", 0))
            lost.add_metric(labels, getattr(peer, "num_lines_lost", 0))
            if getattr(peer, "last_write_time", 0.0):
                last_write.add_metric(labels, peer.last_write_time)
        return [up, started, errors, lost, last_write]


def gauge(name: str, documentation: str, extra_labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, labels=[*LABELS, *extra_labels])


def vllm_aliases(families: list[Metric]) -> Iterator[Metric]:
    """The same samples again under vLLM's names, so vLLM dashboards and alerts work."""
    by_name = {family.name: family for family in families}
    for vllm_name, (our_name, label_renames) in VLLM_ALIASES.items():
        family = by_name[our_name]
        alias = Metric(vllm_name, family.documentation, family.type)
        for sample in family.samples:
            labels = {label_renames.get(key, key): value for key, value in sample.labels.items()}
            suffix = sample.name[len(our_name):]
            alias.samples.append(sample._replace(name=vllm_name + suffix, labels=labels))
        yield alias
