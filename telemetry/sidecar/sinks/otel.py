"""OpenTelemetry traces from the records: one SERVER span per request, sampled iteration spans.

Each request that finishes becomes one trace (or joins the caller's, through its W3C
``traceparent``) placed at its true times, converted from the engine's monotonic clock to
wall time with the engine view's clock anchor (telemetry/sidecar/engine_view.py):

    llm_request (SERVER)  arrival ................................................ finish
      queued              arrival .. first scheduled
      prefill             chunk 0 [start, end]  chunk 1 [start, end]  (one span per chunk)
      decode                                             first token ........... finish
      events: first_token, preempted (one per preemption)

Iterations become spans only when sampled: slower than a threshold, preempting, KV saturated,
or one in N. No prompt or output text is ever put in a span (records carry none).

Exporting never blocks ingest: finished spans go to a bounded queue that one thread exports
(BoundedSpanProcessor); a full queue or a failed export drops spans and counts them, exposed
to Prometheus as ``iterscope_otel_spans_dropped_total`` through ``sidecar_counters()``.
Records of an engine that arrive before its first heartbeat (no clock anchor, no model name
yet) are held back, at most MAX_PENDING_RECORDS per engine, and replayed at that heartbeat
(Ingest admits an engine only with a heartbeat, so this holds records only when the sink is
fed by hand).
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from telemetry.lane.record import (
    EVENT_FINISHED,
    FINISH_REASONS,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
)
from telemetry.sidecar.engine_view import EngineView, record_kv_usage_ratio
from telemetry.sidecar.sink import Sink

DEFAULT_SERVICE_NAME = "iterscope"
TRACER_NAME = "iterscope.sidecar"
MAX_PENDING_RECORDS = 4096  # per engine, held until its first heartbeat
PROTOCOLS = ("grpc", "http/protobuf")
NS_PER_S = 1e9


@dataclass(frozen=True)
class IterationSampling:
    """Which iterations become spans. ``one_in_n`` = 0 turns the periodic sample off."""

    slow_ns: int = 100_000_000
    kv_saturation: float = 0.95
    one_in_n: int = 0

    def __post_init__(self) -> None:
        if self.slow_ns <= 0:
            raise ValueError(f"slow iteration threshold must be > 0 ns, got {self.slow_ns}")
        if not 0 < self.kv_saturation <= 1:
            raise ValueError(f"KV saturation must be in (0, 1], got {self.kv_saturation}")
        if self.one_in_n < 0:
            raise ValueError(f"one-in-N must be >= 0 (0 = off), got {self.one_in_n}")

    def reason(self, record: IterationRecord) -> str | None:
        """Why this iteration is sampled, or None when it is not."""
        if record.num_preemptions:
            return "preempting"
        if record.elapsed_ns >= self.slow_ns:
            return "slow"
        if record_kv_usage_ratio(record) >= self.kv_saturation:
            return "kv_saturated"
        if self.one_in_n and record.iteration % self.one_in_n == 0:
            return "one_in_n"
        return None


class BoundedSpanProcessor(SpanProcessor):
    """Finished spans go to a bounded queue; one thread exports them in batches.

    ``on_end`` (the ingest thread) never blocks and never waits on the network: a full queue
    drops the span and counts it, and every span of a batch the exporter could not deliver is
    counted too, so ``num_dropped`` is exact. (The SDK's BatchSpanProcessor drops as well,
    but only logs a warning per span.)
    """

    def __init__(
        self,
        exporter: SpanExporter,
        max_queue_size: int = 2048,
        max_export_batch_size: int = 512,
        schedule_delay_s: float = 0.5,
    ) -> None:
        if max_queue_size < 1 or max_export_batch_size < 1:
            raise ValueError("span queue and batch sizes must be at least 1")
        self.num_dropped = 0
        self.num_exported = 0
        self._exporter = exporter
        self._max_queue_size = max_queue_size
        self._max_export_batch_size = max_export_batch_size
        self._schedule_delay_s = schedule_delay_s
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._lock = threading.Lock()
        self._flushed = threading.Condition(self._lock)
        self._num_flush_requests = 0
        self._num_flushes_done = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="iterscope-otel", daemon=True)
        self._thread.start()

    def on_start(self, span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            if self._stopping or len(self._queue) >= self._max_queue_size:
                self.num_dropped += 1
                return
            self._queue.append(span)
            if len(self._queue) >= self._max_export_batch_size:
                self._wake.set()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export every span queued before this call; False if that took over the timeout."""
        with self._flushed:
            self._num_flush_requests += 1
            target = self._num_flush_requests
            self._wake.set()
            return self._flushed.wait_for(
                lambda: self._num_flushes_done >= target, timeout_millis / 1000
            )

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._exporter.shutdown()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._schedule_delay_s)
            self._wake.clear()
            with self._lock:
                flush_request = self._num_flush_requests
                stopping = self._stopping
            self._export_queued()
            with self._flushed:
                self._num_flushes_done = flush_request
                self._flushed.notify_all()
            if stopping:
                return

    def _export_queued(self) -> None:
        while batch := self._take_batch():
            try:
                delivered = self._exporter.export(batch) == SpanExportResult.SUCCESS
            except Exception:  # a broken exporter must not kill the export thread
                delivered = False
            with self._lock:
                if delivered:
                    self.num_exported += len(batch)
                else:
                    self.num_dropped += len(batch)

    def _take_batch(self) -> list[ReadableSpan]:
        with self._lock:
            count = min(len(self._queue), self._max_export_batch_size)
            return [self._queue.popleft() for _ in range(count)]


def parent_context(traceparent: str) -> Context | None:
    """The caller's span context from a W3C traceparent; None when absent or malformed."""
    if not traceparent:
        return None
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return context if span_context.is_valid else None


def request_attributes(milestone: RequestMilestone, engine_index: int, model: str) -> dict:
    """GenAI attributes of a finished request. Latencies in seconds, as in vLLM's spans."""
    attributes = {
        "gen_ai.request.id": milestone.request_id,
        "gen_ai.usage.input_tokens": milestone.num_prompt_tokens,
        "gen_ai.usage.output_tokens": milestone.num_output_tokens,
        "gen_ai.usage.cache_read.input_tokens": milestone.num_cached_tokens,
        "gen_ai.latency.e2e": (milestone.finished_ns - milestone.arrival_ns) / NS_PER_S,
        "iterscope.engine_index": engine_index,
        "iterscope.num_preemptions": milestone.num_preemptions,
    }
    if model:
        attributes["gen_ai.request.model"] = model
    if 0 <= milestone.finish_reason < len(FINISH_REASONS):
        attributes["gen_ai.response.finish_reasons"] = (FINISH_REASONS[milestone.finish_reason],)
    if milestone.first_scheduled_ns:
        queue_ns = milestone.first_scheduled_ns - milestone.arrival_ns
        attributes["gen_ai.latency.time_in_queue"] = queue_ns / NS_PER_S
    if milestone.first_token_ns:
        ttft_ns = milestone.first_token_ns - milestone.arrival_ns
        decode_ns = milestone.finished_ns - milestone.first_token_ns
        attributes["gen_ai.latency.time_to_first_token"] = ttft_ns / NS_PER_S
        attributes["gen_ai.latency.time_in_model_decode"] = decode_ns / NS_PER_S
        if milestone.first_scheduled_ns:
            prefill_ns = milestone.first_token_ns - milestone.first_scheduled_ns
            attributes["gen_ai.latency.time_in_model_prefill"] = prefill_ns / NS_PER_S
    return attributes


def iteration_attributes(record: IterationRecord, reason: str) -> dict:
    """The record's counts; those its source marked unknown are left out."""
    attributes = {
        "iterscope.engine_index": record.engine_index,
        "iterscope.iteration": record.iteration,
        "iterscope.sample_reason": reason,
        "iterscope.num_context_reqs": record.num_prefill_reqs,
        "iterscope.num_context_tokens": record.num_prefill_tokens,
        "iterscope.num_generation_reqs": record.num_decode_reqs,
        "iterscope.num_generation_tokens": record.num_decode_tokens,
        "iterscope.num_running_reqs": record.num_running_reqs,
        "iterscope.num_waiting_reqs": record.num_waiting_reqs,
        "iterscope.num_waiting_kv_reqs": record.num_waiting_kv_reqs,
        "iterscope.num_waiting_seq_limit_reqs": record.num_waiting_seq_limit_reqs,
        "iterscope.num_waiting_budget_reqs": record.num_waiting_budget_reqs,
        "iterscope.num_kv_blocks_used": record.num_kv_blocks_used,
        "iterscope.num_kv_blocks_free": record.num_kv_blocks_free,
        "iterscope.kv_usage_ratio": record_kv_usage_ratio(record),
        "iterscope.num_preemptions": record.num_preemptions,
    }
    if record.unknown & UNKNOWN_PREFILL_REQS:
        del attributes["iterscope.num_context_reqs"]
    if record.unknown & UNKNOWN_WAITING_REASONS:
        for reason_field in ("kv", "seq_limit", "budget"):
            del attributes[f"iterscope.num_waiting_{reason_field}_reqs"]
    return attributes


class _EngineTracer:
    """One engine's tracers; their resource names the engine and its model.

    Request spans go through the SDK's sampler (OTEL_TRACES_SAMPLER, parent-based by default,
    so a caller's sampling decision in its traceparent holds). Iteration spans have their own
    provider that records every span it is given: IterationSampling already chose them (slow,
    preempting, KV saturated), and a ratio sampler must not drop the one slow iteration.
    """

    def __init__(self, heartbeat: Heartbeat, service_name: str | None, processor) -> None:
        attributes = {"iterscope.engine_index": heartbeat.engine_index}
        if heartbeat.model_name:
            attributes["iterscope.model"] = heartbeat.model_name
        if heartbeat.device_name:
            attributes["iterscope.device"] = heartbeat.device_name
        if service_name:
            attributes[SERVICE_NAME] = service_name
        resource = Resource.create(attributes)  # adds OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        self.model = heartbeat.model_name
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        iteration_provider = TracerProvider(
            resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False
        )
        iteration_provider.add_span_processor(processor)
        self.iteration_tracer = iteration_provider.get_tracer(TRACER_NAME)


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
        self.num_pending_dropped = 0  # spans lost because their engine never sent a heartbeat
        self._service_name = service_name
        self._engines: dict[int, _EngineTracer] = {}
        self._pending: dict[int, collections.deque[IterationRecord]] = {}

    # --- Sink protocol -------------------------------------------------------------------
    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        finished = [m for m in record.milestones if m.event & EVENT_FINISHED]
        reason = self.sampling.reason(record)
        if not finished and reason is None:
            return
        tracer = self._engines.get(record.engine_index)
        if tracer is None:
            self._hold(record, sum(map(request_span_count, finished)) + (reason is not None))
            return
        for milestone in finished:
            self._emit_request(tracer, engine, milestone)
        if reason is not None:
            self._emit_iteration(tracer, engine, record, reason)

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        if heartbeat.engine_index in self._engines:
            return
        tracer = _EngineTracer(heartbeat, self._service_name, self.processor)
        self._engines[heartbeat.engine_index] = tracer
        for record in self._pending.pop(heartbeat.engine_index, ()):
            self.on_iteration(record, engine)

    def close(self) -> None:
        self.processor.force_flush(timeout_millis=5_000)
        self.processor.shutdown()

    def sidecar_counters(self) -> dict[str, float]:
        """Read by the Prometheus sink at scrape time."""
        return {"otel_spans_dropped": float(self.processor.num_dropped + self.num_pending_dropped)}

    # --- spans ---------------------------------------------------------------------------
    def _hold(self, record: IterationRecord, num_spans: int) -> None:
        pending = self._pending.setdefault(record.engine_index, collections.deque())
        if len(pending) >= MAX_PENDING_RECORDS:
            self.num_pending_dropped += num_spans
            return
        pending.append(record)

    def _emit_request(
        self, engine_tracer: _EngineTracer, engine: EngineView, milestone: RequestMilestone
    ) -> None:
        """The request's spans; request_span_count says how many (keep the two in step)."""
        wall = engine.to_wall_ns
        tracer = engine_tracer.tracer
        root = tracer.start_span(
            "llm_request",
            context=parent_context(milestone.traceparent),
            kind=SpanKind.SERVER,
            start_time=wall(milestone.arrival_ns),
            attributes=request_attributes(milestone, engine.engine_index, engine_tracer.model),
        )
        inside = trace.set_span_in_context(root)
        queue_end_ns = milestone.first_scheduled_ns or milestone.finished_ns
        tracer.start_span(
            "queued", context=inside, start_time=wall(milestone.arrival_ns)
        ).end(end_time=wall(queue_end_ns))
        for index, (start_ns, end_ns, num_tokens) in enumerate(milestone.prefill_chunks):
            chunk = {"iterscope.chunk_index": index, "iterscope.num_tokens": num_tokens}
            tracer.start_span(
                "prefill", context=inside, start_time=wall(start_ns), attributes=chunk
            ).end(end_time=wall(end_ns))
        if milestone.first_token_ns:
            root.add_event("first_token", timestamp=wall(milestone.first_token_ns))
            tracer.start_span(
                "decode", context=inside, start_time=wall(milestone.first_token_ns)
            ).end(end_time=wall(milestone.finished_ns))
        for preempted_ns in milestone.preempted_ns:
            root.add_event("preempted", timestamp=wall(preempted_ns))
        root.end(end_time=wall(milestone.finished_ns))

    def _emit_iteration(self, engine_tracer: _EngineTracer, engine: EngineView,
                        record: IterationRecord, reason: str) -> None:
        start_ns = engine.to_wall_ns(record.start_ns)
        engine_tracer.iteration_tracer.start_span(
            "iteration", start_time=start_ns, attributes=iteration_attributes(record, reason)
        ).end(end_time=start_ns + record.elapsed_ns)


def request_span_count(milestone: RequestMilestone) -> int:
    """Spans _emit_request makes: the request, queued, each prefill chunk, decode if any."""
    return 2 + len(milestone.prefill_chunks) + (1 if milestone.first_token_ns else 0)


# --- sidecar CLI plumbing ----------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--otel-slow-iteration-ms", type=float, default=100.0,
        help="iterations at least this long become spans (default 100)",
    )
    group.add_argument(
        "--otel-kv-saturation", type=float, default=0.95,
        help="iterations with KV usage at or above this ratio become spans (default 0.95)",
    )
    group.add_argument(
        "--otel-iteration-sample-every", type=int, default=0, metavar="N",
        help="also make every Nth iteration a span (default 0 = off)",
    )
    group.add_argument(
        "--otel-max-queued-spans", type=int, default=2048,
        help="spans waiting for export beyond this are dropped and counted (default 2048)",
    )


def traces_protocol(cli_protocol: str | None) -> str:
    protocol = (
        cli_protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol not in PROTOCOLS:
        raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {PROTOCOLS}")
    return protocol


def make_exporter(protocol: str, endpoint: str | None) -> SpanExporter:
    """An OTLP span exporter; ``endpoint`` None lets the exporter read the OTEL_* variables."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {PROTOCOLS}")
    return OTLPSpanExporter(endpoint=endpoint)


def traces_enabled(cli_endpoint: str | None, environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return bool(
        cli_endpoint
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
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
