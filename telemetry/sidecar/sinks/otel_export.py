"""Getting finished spans out of the sidecar: the OTLP exporter, and the bounded queue that one
thread exports from.

Which exporter: traces are on only when an OTLP endpoint is configured (the CLI flag or the
standard OTEL_EXPORTER_OTLP_* variables) and OTEL_SDK_DISABLED / OTEL_TRACES_EXPORTER do not
turn them off; the protocol is grpc or http/protobuf, http/protobuf unless asked otherwise.

Invariants of BoundedSpanProcessor: exporting never blocks ingest (``on_end`` only appends to
a bounded queue), and ``num_dropped`` is exact: a full queue or a failed export drops spans
and counts every one (the sink exposes it to Prometheus as
``iterscope_otel_spans_dropped_total``).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

PROTOCOLS = ("grpc", "http/protobuf")


def traces_enabled(cli_endpoint: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether an OTLP traces endpoint is configured and the OTEL_* variables allow export."""
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


def traces_protocol(cli_protocol: str | None) -> str:
    """The CLI's protocol, else the OTEL_* variables', else http/protobuf."""
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
    # Imported here so that only the chosen protocol's dependencies (grpc) are loaded.
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {PROTOCOLS}")
    return OTLPSpanExporter(endpoint=endpoint)


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

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
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
