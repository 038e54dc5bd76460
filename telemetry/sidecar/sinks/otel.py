"""The OpenTelemetry trace sink: one SERVER span tree per finished request, sampled iteration
spans, one span per live finding, exported over OTLP; also the sink's sidecar flags
(``add_arguments``, ``build``).

What spans a record makes lives in otel_spans.py; how they leave the process (the OTLP
exporter and the bounded queue one thread exports from) in otel_export.py. This module keeps
the state between records: one EngineTracer per engine, created at its first heartbeat.

Invariants: ingest never blocks on export, and every span lost is counted, exposed to
Prometheus as ``iterscope_otel_spans_dropped_total`` through ``sidecar_counters()``. Ingest
admits an engine only with a heartbeat, which the sink sees first (its clock anchor and model
name); a record of an engine with no tracer, which only a sink fed by hand gets, counts as the
spans it would have made (docs/tracing.md: records before a restarted sidecar meets an engine
are rejected by Ingest, counted there).

A live finding's span is made when it closes. Findings still open when the sidecar stops (or
when their engine is no longer tracked) are exported then, ``iterscope.finding.state`` "open",
ending at the last time seen of their engine: its newest message, or the finding's own end if
later (a stall or death is extended to the last tick). The open findings are read from the
engine view (``engine.findings.open``), never kept here a second time.
"""

from __future__ import annotations

import argparse

from opentelemetry.sdk.trace.export import SpanExporter

from telemetry.analysis.live_findings import FindingEvent, LiveFinding
from telemetry.lane.record import EVENT_FINISHED, Heartbeat, IterationRecord
from telemetry.lane.recording import message_time_ns
from telemetry.sidecar.engine_view import EngineView
from telemetry.sidecar.sink import Sink
from telemetry.sidecar.sinks.otel_export import (
    PROTOCOLS,
    BoundedSpanProcessor,
    make_exporter,
    traces_enabled,
    traces_protocol,
)
from telemetry.sidecar.sinks.otel_spans import (
    EngineTracer,
    IterationSampling,
    emit_finding_span,
    emit_iteration_span,
    emit_request_spans,
    request_span_count,
)


class OtelSink(Sink):
    """The sidecar's trace sink (see the module docstring)."""

    name = "otel"

    def __init__(
        self,
        exporter: SpanExporter,
        sampling: IterationSampling | None = None,
        service_name: str | None = None,
        max_queue_size: int = 2048,
        schedule_delay_s: float = 0.5,
    ) -> None:
        """``service_name`` None: OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, else iterscope."""
        self.sampling = sampling or IterationSampling()
        self.processor = BoundedSpanProcessor(
            exporter, max_queue_size=max_queue_size, schedule_delay_s=schedule_delay_s
        )
        self.num_unplaced = 0  # spans with no tracer to place them: no heartbeat seen
        self._service_name = service_name
        self._engines: dict[int, EngineTracer] = {}
        self._finding_views: dict[int, EngineView] = {}  # engines that had a finding

    # --- Sink protocol -------------------------------------------------------------------
    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        finished = [m for m in record.milestones if m.event & EVENT_FINISHED]
        reason = self.sampling.reason(record)
        if not finished and reason is None:
            return
        tracer = self._engines.get(record.engine_index)
        if tracer is None:  # no heartbeat seen (Ingest admits none without)
            self.num_unplaced += sum(map(request_span_count, finished)) + (reason is not None)
            return
        for milestone in finished:
            emit_request_spans(tracer, engine, milestone)
        if reason is not None:
            emit_iteration_span(tracer, engine, record, reason)

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        if heartbeat.engine_index in self._engines:
            return
        self._engines[heartbeat.engine_index] = EngineTracer(
            heartbeat, self._service_name, self.processor
        )

    def on_finding(self, event: FindingEvent, engine: EngineView) -> None:
        self._finding_views[engine.engine_index] = engine
        if event.what == "closed":
            self._emit_finding(event.finding, engine, event.finding.end_ns)

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        """Its open findings are exported now (they will not close); a new engine of this
        index gets a tracer of its own, with its own model in the resource."""
        engine = self._finding_views.pop(engine_index, None)
        if engine is not None:
            self._emit_open_findings(engine)
        self._engines.pop(engine_index, None)

    def close(self) -> None:
        for engine in self._finding_views.values():
            self._emit_open_findings(engine)
        self._finding_views.clear()
        self.processor.force_flush(timeout_millis=5_000)
        self.processor.shutdown()

    def sidecar_counters(self) -> dict[str, float]:
        """Read by the Prometheus sink at scrape time."""
        return {"otel_spans_dropped": float(self.processor.num_dropped + self.num_unplaced)}

    def _emit_open_findings(self, engine: EngineView) -> None:
        findings = engine.findings
        if findings is None:
            return
        last_seen_ns = message_time_ns(findings.messages[-1]) if findings.messages else 0
        for finding in list(findings.open):
            self._emit_finding(finding, engine, max(finding.end_ns, last_seen_ns))

    def _emit_finding(self, finding: LiveFinding, engine: EngineView, end_ns: int) -> None:
        tracer = self._engines.get(engine.engine_index)
        if tracer is None:  # no heartbeat seen (Ingest admits none without): nowhere to place it
            self.num_unplaced += 1
            return
        emit_finding_span(tracer, engine, finding, end_ns)


# --- sidecar CLI plumbing ----------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace flags; each defaults to its standard OTEL_* variable where one exists."""
    group = parser.add_argument_group("OpenTelemetry traces (standard OTEL_* variables apply)")
    group.add_argument(
        "--otlp-traces-endpoint",
        help="OTLP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces (http/protobuf) or "
        "http://127.0.0.1:4317 (grpc); default OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT; traces are off when none is set",
    )
    group.add_argument(
        "--otlp-traces-protocol",
        choices=PROTOCOLS,
        help="default OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL, "
        "else http/protobuf",
    )
    group.add_argument(
        "--otel-slow-iteration-ms",
        type=float,
        default=100.0,
        help="iterations at least this long become spans (default 100)",
    )
    group.add_argument(
        "--otel-kv-saturation",
        type=float,
        default=0.95,
        help="iterations with KV usage at or above this ratio become spans (default 0.95)",
    )
    group.add_argument(
        "--otel-iteration-sample-every",
        type=int,
        default=0,
        metavar="N",
        help="also make every Nth iteration a span (default 0 = off)",
    )
    group.add_argument(
        "--otel-max-queued-spans",
        type=int,
        default=2048,
        help="spans waiting for export beyond this are dropped and counted (default 2048)",
    )


def build(args: argparse.Namespace) -> OtelSink | None:
    """The sink, or None when no OTLP endpoint is configured."""
    if not traces_enabled(args.otlp_traces_endpoint):
        return None
    sampling = IterationSampling(
        slow_ns=int(args.otel_slow_iteration_ms * 1e6),
        kv_saturation=args.otel_kv_saturation,
        one_in_n=args.otel_iteration_sample_every,
    )
    exporter = make_exporter(traces_protocol(args.otlp_traces_protocol), args.otlp_traces_endpoint)
    return OtelSink(exporter, sampling, max_queue_size=args.otel_max_queued_spans)
