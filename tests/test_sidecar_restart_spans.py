"""What a restarted sidecar makes of records that reach it before an engine's heartbeat
(docs/tracing.md, "Across a sidecar restart": our publisher sends a heartbeat first after a
failed send, so only a race or another publisher gets here): rejected, so no spans, and
counted as rejected frames, as lost messages and as a gap in the recording, never as dropped
spans."""

from pathlib import Path

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry.lane.record import EVENT_FINISHED, RequestMilestone, heartbeat, iteration_record
from telemetry.lane.recording import message_time_ns, read_recording
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.sinks.jsonl import JsonlSink
from telemetry.sidecar.sinks.otel import OtelSink

TRACING_DOC = Path(__file__).parent.parent / "docs" / "tracing.md"
MS = 1_000_000
MONO_BASE_NS = 5_000 * MS
WALL_OFFSET_NS = 1_700_000_000_000_000_000


def beat(msg_seq: int, iteration: int):
    ts_ns = MONO_BASE_NS + iteration * 10 * MS
    return heartbeat(0, msg_seq, ts_ns, ts_ns + WALL_OFFSET_NS, model_name="m", device_name="CPU")


def step(msg_seq: int, finishes: str = ""):
    """Iteration ``msg_seq`` (one message per iteration here); ``finishes``: a request id."""
    start_ns = MONO_BASE_NS + msg_seq * 10 * MS
    milestones = []
    if finishes:
        milestones.append(
            RequestMilestone(
                request_id=finishes,
                event=EVENT_FINISHED,
                arrival_ns=start_ns - 50 * MS,
                first_scheduled_ns=start_ns - 40 * MS,
                first_token_ns=start_ns - 30 * MS,
                finished_ns=start_ns,
                num_prompt_tokens=10,
                num_cached_tokens=0,
                num_output_tokens=3,
                num_preemptions=0,
                finish_reason=0,
                prefill_chunks=[(start_ns - 40 * MS, start_ns - 30 * MS, 10)],
            )
        )
    return iteration_record(
        0, msg_seq, msg_seq, start_ns=start_ns, elapsed_ns=9 * MS, milestones=milestones
    )


def feed(ingest: Ingest, messages: list) -> None:
    for message in messages:
        ingest.on_message(message, message_time_ns(message))


def test_records_before_the_heartbeat_of_a_restarted_sidecar_make_no_spans(tmp_path):
    path = tmp_path / "rec.jsonl"
    killed = Ingest([JsonlSink(path)], live_findings=False)  # the sidecar before kill -9
    feed(killed, [beat(1, 1), *(step(seq) for seq in range(2, 6))])
    killed.close()

    exporter = InMemorySpanExporter()
    otel = OtelSink(exporter, schedule_delay_s=0.01)
    recording = JsonlSink(path)
    restarted = Ingest(
        [otel, recording], live_findings=False, known_last_seqs=recording.known_last_seqs()
    )
    # 6 and 7 were sent while no sidecar listened; 8 and 9 arrive before the heartbeat
    feed(restarted, [step(8, finishes="lost-a"), step(9, finishes="lost-b")])
    feed(restarted, [beat(10, 10), step(11, finishes="kept")])
    restarted.close()

    requests = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert [span.attributes["gen_ai.request.id"] for span in requests] == ["kept"]
    assert restarted.health.num_rejected["unknown_engine"] == 2
    assert otel.sidecar_counters() == {"otel_spans_dropped": 0.0}
    assert restarted.engines[0].view.num_dropped_total == 4  # seqs 6 to 9
    assert [message.msg_seq for message in read_recording(path)] == [1, 2, 3, 4, 5, 10, 11]


def test_the_tracing_doc_says_what_a_restart_loses():
    text = TRACING_DOC.read_text()
    section = text[text.index("## Across a sidecar restart") :]
    section = section[: section.index("\n## ", 1)]
    assert "held, up to 4096" not in text
    for counted in (
        'iterscope_frames_rejected_total{reason="unknown_engine"}',
        "iterscope_records_dropped_total",
        "`iterscope_otel_spans_dropped_total` does not count them",
    ):
        assert counted in section
