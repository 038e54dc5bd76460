"""An OTLP/HTTP receiver on 127.0.0.1 that decodes the real protobuf wire format and keeps
every span, for the OTel sink's tests."""

from __future__ import annotations

import gzip
import http.server
import threading
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from telemetry.sidecar.sinks.otel import OtelSink
from telemetry.sidecar.sinks.otel_export import make_exporter
from tests.helpers.wait import wait_until


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, int]]
    resource: dict


def any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(item) for item in value.array_value.values)
    return getattr(value, kind) if kind else None


def key_values(pairs) -> dict:
    return {kv.key: any_value(kv.value) for kv in pairs}


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
        resource = key_values(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=key_values(span.attributes),
                        events=[(event.name, event.time_unix_nano) for event in span.events],
                        resource=resource,
                    )
                )
    return spans


class OtlpHttpReceiver:
    """POST /v1/traces on 127.0.0.1, a free port; keeps every span it decodes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        lock = self._lock = threading.Lock()
        spans = self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                decoded = decode_spans(body)
                with lock:
                    spans.extend(decoded)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, num_spans: int, timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Every span received, once there are at least ``num_spans``."""

        def received() -> list[ReceivedSpan] | None:
            with self._lock:
                return list(self.spans) if len(self.spans) >= num_spans else None

        return wait_until(
            received, timeout_s, lambda: f"{num_spans} spans (received {len(self.spans)})"
        )


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.name == name]


def http_sink(endpoint: str, **kwargs) -> OtelSink:
    return OtelSink(make_exporter("http/protobuf", endpoint), schedule_delay_s=0.05, **kwargs)
