"""OTel sink: spans received over the real OTLP wire format (protobuf over HTTP, and gRPC
through the rotel collector), with the right names, parentage, attributes and times; a span per
live finding, from the findings a real Ingest opens and closes."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.sdk.trace.export import SpanExportResult

from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
    SpecDecodeCounts,
    iteration_record,
)
from telemetry.lane.record import heartbeat as lane_heartbeat
from telemetry.lane.recording import message_time_ns
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.sink import Sink
from telemetry.sidecar.sinks import otel, otel_export
from telemetry.sidecar.sinks.otel import OtelSink
from telemetry.sidecar.sinks.otel_export import make_exporter
from telemetry.sidecar.sinks.otel_spans import IterationSampling, iteration_attributes
from tests.helpers.net import free_port
from tests.helpers.otel import (
    OtlpHttpReceiver,
    by_name,
    http_sink,
)
from tests.helpers.sink_feed import send
from tests.helpers.wait import wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
MONO_BASE_NS = 5_000_000_000
WALL_OFFSET_NS = 1_700_000_000_000_000_000 - MONO_BASE_NS


@pytest.fixture
def receiver():
    server = OtlpHttpReceiver()
    yield server
    server.close()


# --- synthetic records --------------------------------------------------------------------
def heartbeat(engine_index: int = 0) -> Heartbeat:
    return lane_heartbeat(
        engine_index,
        1,
        MONO_BASE_NS,
        MONO_BASE_NS + WALL_OFFSET_NS,
        model_name="SmolLM2-135M",
        device_name="CPU",
        block_size=16,
        num_kv_blocks_total=1000,
    )


def record(iteration: int, milestones=(), engine_index: int = 0, **overrides) -> IterationRecord:
    fields = dict(
        start_ns=MONO_BASE_NS + iteration * 10_000_000,
        elapsed_ns=9_000_000,
        num_decode_reqs=2,
        num_decode_tokens=2,
        num_running_reqs=2,
        num_kv_blocks_used=100,
        num_kv_blocks_free=900,
        num_kv_tokens=1600,
        milestones=list(milestones),
    )
    return iteration_record(engine_index, iteration, iteration, **{**fields, **overrides})


def finished(request_id: str, traceparent: str = "", base_ns: int = MONO_BASE_NS):
    """A request: queued 1 ms, two prefill chunks, preempted once, 7 output tokens, stop."""
    return RequestMilestone(
        request_id=request_id,
        event=EVENT_FINISHED,
        arrival_ns=base_ns + 1_000_000,
        first_scheduled_ns=base_ns + 2_000_000,
        first_token_ns=base_ns + 6_000_000,
        finished_ns=base_ns + 20_000_000,
        num_prompt_tokens=300,
        num_cached_tokens=64,
        num_output_tokens=7,
        num_preemptions=1,
        finish_reason=0,
        traceparent=traceparent,
        preempted_ns=[base_ns + 10_000_000],
        prefill_chunks=[
            (base_ns + 2_000_000, base_ns + 4_000_000, 256),
            (base_ns + 4_000_000, base_ns + 6_000_000, 44),
        ],
    )


def wall(monotonic_ns: int) -> int:
    return monotonic_ns + WALL_OFFSET_NS


# --- tests ----------------------------------------------------------------------------------
def test_request_span_tree_over_http_protobuf(receiver):
    sink = http_sink(receiver.endpoint)
    send(sink, heartbeat())
    milestone = finished("req-1", TRACEPARENT)
    first_token_only = RequestMilestone(
        request_id="req-2",
        event=EVENT_FIRST_TOKEN,
        arrival_ns=MONO_BASE_NS,
        first_scheduled_ns=MONO_BASE_NS,
        first_token_ns=MONO_BASE_NS + 1,
        finished_ns=0,
        num_prompt_tokens=5,
        num_cached_tokens=0,
        num_output_tokens=1,
        num_preemptions=0,
        finish_reason=-1,
    )
    send(sink, record(1, [milestone, first_token_only]))
    sink.close()
    spans = receiver.wait_for(5)  # llm_request, queued, 2 x prefill, decode
    assert sorted(span.name for span in spans) == [
        "decode",
        "llm_request",
        "prefill",
        "prefill",
        "queued",
    ]

    (root,) = by_name(spans, "llm_request")
    assert root.kind == SpanProto.SPAN_KIND_SERVER
    assert (root.trace_id, root.parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)
    assert (root.start_ns, root.end_ns) == (wall(milestone.arrival_ns), wall(milestone.finished_ns))
    assert root.attributes["gen_ai.request.id"] == "req-1"
    assert root.attributes["gen_ai.request.model"] == "SmolLM2-135M"
    assert root.attributes["gen_ai.usage.input_tokens"] == 300
    assert root.attributes["gen_ai.usage.output_tokens"] == 7
    assert root.attributes["gen_ai.usage.cache_read.input_tokens"] == 64
    assert root.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert root.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(0.005)
    assert root.attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.001)
    assert root.attributes["iterscope.num_preemptions"] == 1
    assert root.events == [
        ("first_token", wall(milestone.first_token_ns)),
        ("preempted", wall(milestone.preempted_ns[0])),
    ]
    assert root.resource["service.name"] == "iterscope"
    assert root.resource["iterscope.engine_index"] == 0
    assert root.resource["iterscope.model"] == "SmolLM2-135M"

    for child in by_name(spans, "queued") + by_name(spans, "prefill") + by_name(spans, "decode"):
        assert (child.trace_id, child.parent_span_id) == (TRACE_ID, root.span_id)
    (queued,) = by_name(spans, "queued")
    assert (queued.start_ns, queued.end_ns) == (
        wall(milestone.arrival_ns),
        wall(milestone.first_scheduled_ns),
    )
    chunks = sorted(by_name(spans, "prefill"), key=lambda span: span.start_ns)
    assert [(c.start_ns, c.end_ns, c.attributes["iterscope.num_tokens"]) for c in chunks] == [
        (wall(start), wall(end), num) for start, end, num in milestone.prefill_chunks
    ]
    (decode,) = by_name(spans, "decode")
    assert (decode.start_ns, decode.end_ns) == (
        wall(milestone.first_token_ns),
        wall(milestone.finished_ns),
    )
    for span in spans:
        assert not any("prompt" in key or "completion" in key for key in span.attributes)
    assert sink.sidecar_counters() == {"otel_spans_dropped": 0.0}


def test_an_iteration_span_carries_its_drafts_only_where_it_scored_some():
    plain = iteration_record(0, 1, 1, num_decode_reqs=4, num_decode_tokens=4)
    assert not [key for key in iteration_attributes(plain, "every") if "draft" in key]
    drafting = iteration_record(
        0, 2, 2, num_decode_reqs=4, num_decode_tokens=7, spec_decode=SpecDecodeCounts(3, 9, 3)
    )
    attributes = iteration_attributes(drafting, "every")
    assert attributes["iterscope.num_generation_tokens"] == 7
    assert (
        attributes["iterscope.num_drafts"],
        attributes["iterscope.num_draft_tokens"],
        attributes["iterscope.num_accepted_tokens"],
    ) == (3, 9, 3)


# --- live findings --------------------------------------------------------------------------
class FindingEvents(Sink):
    """Every live finding event, as the OTel sink beside it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def on_finding(self, event, engine) -> None:
        self.events.append((event.what, event.finding))


def kv_stream(engine_index: int, kv_used: list[int], first_seq: int = 1) -> list:
    """An engine decoding 4 requests, one 100 ms iteration per entry of ``kv_used`` (KV blocks
    used of 1000; above 950, 2 more requests wait for KV), a heartbeat before every tenth;
    consecutive seqs from ``first_seq``."""
    messages, seq = [], first_seq
    for iteration, used in enumerate(kv_used, 1):
        start_ns = MONO_BASE_NS + iteration * 100_000_000
        if iteration % 10 == 1:
            messages.append(
                lane_heartbeat(
                    engine_index,
                    seq,
                    start_ns,
                    start_ns + WALL_OFFSET_NS,
                    last_iteration=iteration - 1,
                    num_running_reqs=4,
                    num_waiting_reqs=2 if used > 950 else 0,
                    model_name="SmolLM2-135M",
                    num_kv_blocks_total=1000,
                )
            )
            seq += 1
        messages.append(
            iteration_record(
                engine_index,
                seq,
                iteration,
                start_ns=start_ns,
                elapsed_ns=99_000_000,
                num_decode_reqs=4,
                num_decode_tokens=4,
                num_running_reqs=4,
                num_waiting_reqs=2 if used > 950 else 0,
                num_waiting_kv_reqs=2 if used > 950 else 0,
                num_kv_blocks_used=used,
                num_kv_blocks_free=1000 - used,
            )
        )
        seq += 1
    return messages


def feed(ingest: Ingest, messages: list) -> None:
    """As a replay does: the clock is record time, a tick before each message."""
    for message in messages:
        now_ns = message_time_ns(message)
        ingest.tick(now_ns)
        ingest.on_message(message, now_ns)


SATURATED, EASY = 970, 300


def test_a_span_per_live_finding_closed_or_still_open_at_close(receiver):
    """KV saturated (2 requests waiting) for 3 s, eased for 3 s, saturated again until the
    sidecar stops: each stretch is a kv_saturation and a waiting_kv finding. The first two
    close (their spans end where the findings end), the last two are open at close (their
    spans end at the engine's last message, marked open); each span says what /findings says."""
    sink, seen = http_sink(receiver.endpoint), FindingEvents()
    ingest = Ingest([sink, seen])
    messages = kv_stream(0, [SATURATED] * 30 + [EASY] * 30 + [SATURATED] * 30)
    feed(ingest, messages)
    ingest.close()
    spans = [span for span in receiver.wait_for(4) if span.name.startswith("finding ")]
    closed = [f for what, f in seen.events if what == "closed"]
    still_open = [f for what, f in seen.events if what == "opened" and not f.closed]
    assert sorted(f.kind for f in closed) == sorted(f.kind for f in still_open)
    assert sorted(f.kind for f in closed) == ["kv_saturation", "waiting_kv"]
    assert len(spans) == 4  # beside them: the saturated iterations, sampled
    last_message_ns = message_time_ns(messages[-1])
    assert all(f.end_ns < last_message_ns for f in still_open)  # searched a second ago
    for finding in closed + still_open:
        state = "closed" if finding.closed else "open"
        (span,) = [
            span
            for span in by_name(spans, f"finding {finding.kind}")
            if span.attributes["iterscope.finding.state"] == state
        ]
        end_ns = finding.end_ns if finding.closed else last_message_ns
        assert (span.start_ns, span.end_ns) == (wall(finding.start_ns), wall(end_ns))
        assert span.parent_span_id == "" and span.kind == SpanProto.SPAN_KIND_INTERNAL
        assert span.attributes == {
            "iterscope.engine_index": 0,
            "iterscope.finding.kind": finding.kind,
            "iterscope.finding.title": finding.title,
            "iterscope.finding.state": state,
            "iterscope.finding.start_iteration": 1 if finding.closed else 61,
            "iterscope.finding.cost_request_seconds": pytest.approx(finding.cost),
            "iterscope.finding.cost_label": finding.cost_label,
            "iterscope.finding.evidence": finding.evidence,
            "iterscope.finding.action": finding.action,
            "iterscope.finding.truncated": False,
        }
        assert finding.cost > 0 and finding.evidence and finding.action
        assert span.resource["iterscope.model"] == "SmolLM2-135M"
    assert sink.sidecar_counters() == {"otel_spans_dropped": 0.0}


def finding_spans(receiver: OtlpHttpReceiver, num_spans: int) -> list:
    """The finding spans received, once there are ``num_spans`` of them."""

    def received() -> list | None:
        spans = [span for span in list(receiver.spans) if span.name.startswith("finding ")]
        return spans if len(spans) >= num_spans else None

    return wait_until(received, 20, f"{num_spans} finding spans")


def test_findings_of_an_engine_no_longer_tracked_are_exported_open(receiver, monkeypatch):
    """Engine 0 dies saturated; engine 1 takes its place (--max-engines 1): engine 0's open
    findings (saturation, waiting, its death) are exported then, past the SDK's sampler, and
    once only; engine 1 gets a tracer of its own (its resource names its model)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    sink = http_sink(receiver.endpoint)
    ingest = Ingest([sink], dead_after_s=1.0, evict_after_s=1.0, max_engines=1)
    first = kv_stream(0, [SATURATED] * 30)
    feed(ingest, first)
    last_ns = message_time_ns(first[-1])
    for tick in range(1, 31):  # 3 s of silence: engine 0 is dead
        ingest.tick(last_ns + tick * 100_000_000)
    assert [f.kind for f in ingest.engines[0].findings.open][-1] == "dead"
    now_ns = last_ns + 3_100_000_000
    newcomer = lane_heartbeat(1, 1, now_ns, now_ns + WALL_OFFSET_NS, model_name="other")
    ingest.on_message(newcomer, now_ns)
    assert list(ingest.engines) == [1]
    spans = finding_spans(receiver, 3)
    assert sorted(span.name for span in spans) == [
        "finding dead",
        "finding kv_saturation",
        "finding waiting_kv",
    ]
    assert {span.attributes["iterscope.finding.state"] for span in spans} == {"open"}
    assert {span.resource["iterscope.model"] for span in spans} == {"SmolLM2-135M"}
    (dead,) = by_name(spans, "finding dead")
    assert dead.attributes["iterscope.finding.cost_label"] == "halted"
    assert dead.end_ns == wall(now_ns - 100_000_000)  # the last tick before the newcomer
    ingest.on_message(record(2, engine_index=1, num_preemptions=1), now_ns)  # sampled
    ingest.close()
    assert len(finding_spans(receiver, 3)) == 3  # close() flushed: none exported twice
    (iteration,) = [
        span
        for span in by_name(receiver.spans, "iteration")
        if span.attributes["iterscope.engine_index"] == 1
    ]
    assert iteration.resource["iterscope.model"] == "other"


def test_iteration_sampling_reasons():
    sampling = IterationSampling(slow_ns=50_000_000, kv_saturation=0.9, one_in_n=100)
    assert sampling.reason(record(7)) is None
    assert sampling.reason(record(7, num_preemptions=2)) == "preempting"
    assert sampling.reason(record(7, elapsed_ns=50_000_000)) == "slow"
    assert sampling.reason(record(7, num_kv_blocks_used=900, num_kv_blocks_free=100)) == (
        "kv_saturated"
    )
    assert sampling.reason(record(300)) == "one_in_n"
    assert IterationSampling().reason(record(300)) is None
    with pytest.raises(ValueError, match="KV saturation"):
        IterationSampling(kv_saturation=1.5)


def test_unsampled_iterations_and_bad_traceparent(receiver):
    sink = http_sink(receiver.endpoint)
    send(sink, heartbeat())
    for iteration in range(1, 50):
        send(sink, record(iteration))  # none sampled
    send(sink, record(50, [finished("r", traceparent="00-garbage-01")]))
    sink.close()
    spans = receiver.wait_for(5)  # close() returned after the export: nothing more comes
    assert len(receiver.spans) == 5 and not by_name(spans, "iteration")
    (root,) = by_name(spans, "llm_request")
    assert root.parent_span_id == ""


def test_the_sdk_sampler_thins_request_spans_but_never_chosen_iterations(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    sink = http_sink(receiver.endpoint, sampling=IterationSampling(slow_ns=50_000_000))
    send(sink, heartbeat())
    send(sink, record(1, [finished("r")]))  # request spans: dropped by the sampler
    send(sink, record(2, elapsed_ns=80_000_000))  # slow: chosen by our own sampling
    sink.close()
    spans = receiver.wait_for(1)
    assert [span.name for span in spans] == ["iteration"]


class HungExporter:
    """A collector that hangs until released: the ingest side must not wait for it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()  # an export is in progress (and hangs)
        self.num_exported = 0

    def export(self, spans) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        self.num_exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_hung_collector_never_blocks_ingest_and_drops_are_counted():
    exporter = HungExporter()
    sink = OtelSink(exporter, max_queue_size=4, schedule_delay_s=0.01)
    send(sink, heartbeat())
    num_requests = 40

    def ingest(first: int, last: int) -> None:
        for iteration in range(first, last + 1):  # 5 spans per request
            send(sink, record(iteration, [finished(f"r{iteration}")]))

    ingest(1, 4)
    assert exporter.entered.wait(10), "the exporter never received a batch"
    feeder = threading.Thread(target=ingest, args=(5, num_requests))  # while export hangs
    feeder.start()
    feeder.join(timeout=10)  # the hung export would hold a waiting ingest for 30 s
    assert not feeder.is_alive(), "ingest waited for the hung collector"
    exporter.release.set()
    sink.close()
    num_dropped = sink.sidecar_counters()["otel_spans_dropped"]
    assert exporter.num_exported + num_dropped == 5 * num_requests
    assert num_dropped >= 5 * num_requests - 8  # at most one batch in flight + a full queue


def test_records_of_an_engine_with_no_heartbeat_count_every_span():
    """Ingest admits an engine only with a heartbeat; a sink fed a record of one with none
    has nowhere to place its spans: each counts as dropped (5 for a request, 1 for an
    iteration), none is made later."""
    sink = OtelSink(HungExporter(), schedule_delay_s=0.01)
    send(sink, record(1, [finished("a")]))
    send(sink, record(2, num_preemptions=1))  # a preempting iteration: one span
    assert sink.sidecar_counters() == {"otel_spans_dropped": 6.0}
    send(sink, heartbeat())
    assert sink.sidecar_counters() == {"otel_spans_dropped": 6.0}
    sink.processor.shutdown()


def test_failed_exports_count_as_dropped():
    class FailingExporter:
        def export(self, spans):
            return SpanExportResult.FAILURE

        def shutdown(self):
            pass

    sink = OtelSink(FailingExporter(), schedule_delay_s=0.01)
    send(sink, heartbeat())
    send(sink, record(1, [finished("a"), finished("b")]))
    sink.close()
    assert sink.sidecar_counters() == {"otel_spans_dropped": 10.0}


def test_build_reads_cli_and_standard_environment(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    otel.add_arguments(parser)
    for name in (
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    ):
        monkeypatch.delenv(name, raising=False)
    assert otel.build(parser.parse_args([])) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert otel_export.traces_protocol(None) == "grpc"
    assert otel_export.traces_protocol("http/protobuf") == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="unsupported OTLP protocol"):
        otel_export.traces_protocol(None)
    args = parser.parse_args(
        [
            "--otlp-traces-endpoint",
            "http://127.0.0.1:1/v1/traces",
            "--otlp-traces-protocol",
            "http/protobuf",
            "--otel-iteration-sample-every",
            "10",
        ]
    )
    sink = otel.build(args)
    try:
        assert isinstance(sink, OtelSink) and sink.sampling.one_in_n == 10
    finally:
        sink.close()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert otel.build(args) is None


# --- gRPC through a real collector ----------------------------------------------------------
def rotel_binary() -> Path:
    spec = importlib.util.find_spec("rotel")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the rotel package is not installed (pip install rotel)")
    binary = Path(spec.submodule_search_locations[0]) / "rotel-agent"
    if not binary.exists():
        raise RuntimeError(f"rotel collector binary not found at {binary}")
    return binary


def wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 15.0) -> None:
    def listening() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"rotel exited with {process.returncode}")
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, timeout_s, f"rotel to listen on port {port}")


@pytest.mark.live
def test_grpc_export_through_rotel_collector(receiver, tmp_path, monkeypatch):
    grpc_port, http_port = free_port(), free_port()
    command = [
        str(rotel_binary()),
        "start",
        "--otlp-grpc-endpoint",
        f"127.0.0.1:{grpc_port}",
        "--otlp-http-endpoint",
        f"127.0.0.1:{http_port}",
        "--exporter",
        "otlp",
        "--otlp-exporter-protocol",
        "http",
        "--otlp-exporter-endpoint",
        f"http://127.0.0.1:{receiver.port}",
        "--batch-timeout",
        "50ms",
        "--pid-file",
        str(tmp_path / "rotel.pid"),
        "--log-file",
        str(tmp_path / "rotel.log"),
    ]
    rotel = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(grpc_port, rotel)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "iterscope-test")
        sink = OtelSink(
            make_exporter("grpc", f"http://127.0.0.1:{grpc_port}"), schedule_delay_s=0.05
        )
        send(sink, heartbeat())
        milestone = finished("via-rotel", TRACEPARENT)
        send(sink, record(1, [milestone]))
        sink.close()
        spans = receiver.wait_for(5)
    finally:
        rotel.terminate()
        rotel.wait(10)
    (root,) = by_name(spans, "llm_request")
    assert (root.trace_id, root.parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)
    assert root.start_ns == wall(milestone.arrival_ns)
    assert root.attributes["gen_ai.request.id"] == "via-rotel"
    assert root.resource["service.name"] == "iterscope-test"
    assert sink.sidecar_counters() == {"otel_spans_dropped": 0.0}


@pytest.mark.live
def test_through_the_sidecar_from_a_real_publisher(receiver, tmp_path):
    """Engine publisher -> ZMQ lane -> `iterscope sidecar --otlp-traces-endpoint` -> OTLP."""
    import signal
    import sys

    from telemetry.lane.publisher import ZmqPublisher

    address = f"ipc://{tmp_path}/lane.sock"
    repo = Path(__file__).resolve().parent.parent
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.entrypoints.cli",
            "sidecar",
            "--address",
            address,
            "--no-log",
            "--no-metrics",
            "--otlp-traces-endpoint",
            receiver.endpoint,
        ],
        cwd=repo,
        stderr=subprocess.PIPE,
        text=True,
    )
    publisher = None
    try:

        def bound() -> bool:
            if sidecar.poll() is not None:
                raise AssertionError(f"sidecar exited: {sidecar.stderr.read()}")
            return (tmp_path / "lane.sock").exists()

        wait_until(bound, 30, "the sidecar to bind its lane")
        publisher = ZmqPublisher(
            address, engine_index=0, facts={"model_name": "m"}, heartbeat_interval_s=0.05
        )
        now_ns = time.monotonic_ns()
        milestone = finished("e2e", TRACEPARENT, base_ns=now_ns)

        def published_and_received() -> bool:
            # Keep publishing until the sidecar is connected (lossy lane: early sends drop).
            publisher.publish(record(1, [milestone], start_ns=now_ns))
            return bool(receiver.spans)

        wait_until(published_and_received, 30, "spans from the sidecar", interval_s=0.2)
        spans = receiver.wait_for(5)
    finally:
        if publisher is not None:
            publisher.close()
        sidecar.send_signal(signal.SIGINT)
        sidecar.wait(30)
    roots = by_name(spans, "llm_request")
    assert roots and all(r.attributes["gen_ai.request.id"] == "e2e" for r in roots)
    assert (roots[0].trace_id, roots[0].parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)
    assert roots[0].resource["iterscope.model"] == "m"
    # Wall placement from the real heartbeat anchor: within a second of now.
    wall_offset_ns = time.time_ns() - time.monotonic_ns()
    assert abs(roots[0].start_ns - (milestone.arrival_ns + wall_offset_ns)) < 1e9


def test_wall_clock_uses_the_latest_anchor_and_refuses_without_one():
    from telemetry.sidecar.engine_view import EngineView

    engine = EngineView(0)
    with pytest.raises(KeyError, match="no clock anchor"):
        engine.to_wall_ns(123)
    engine.take_anchor(heartbeat())
    assert engine.to_wall_ns(MONO_BASE_NS + 7) == MONO_BASE_NS + 7 + WALL_OFFSET_NS
    stepped = heartbeat()
    stepped.wall_ns += 2_000_000_000  # NTP stepped the wall clock by 2 s
    engine.apply_heartbeat(stepped)
    assert engine.to_wall_ns(MONO_BASE_NS) == MONO_BASE_NS + WALL_OFFSET_NS + 2_000_000_000
