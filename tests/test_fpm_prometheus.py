"""The Prometheus series of FPM: the gauges of what FPM producers say beyond the record's
fields (only for engines whose records carry them), and the counter of ``--fpm-port``."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.lane.record import (
    UNKNOWN_MILESTONES,
    IterationRecord,
    make_decoder,
    make_encoder,
)
from telemetry.sidecar.fpm_engines import FpmEngines
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.replay import replay
from telemetry.sidecar.sinks import prometheus
from telemetry.sidecar.sinks.fpm_publisher import FpmPublisherSink
from telemetry.sidecar.sinks.jsonl import JsonlSink
from telemetry.sidecar.sinks.prometheus import FPM_GAUGES, PrometheusSink
from telemetry.sources.fpm import decode_frames, to_record
from tests.helpers.fpm import busy_frames
from tests.helpers.lane import heartbeat, synthetic_record
from tests.helpers.sink_feed import health_of, send

S = 1_000_000_000
# busy_frames' message, as the gauges show it
BUSY_GAUGES = {
    "iterscope_fpm_prefill_kv_tokens": 32,
    "iterscope_fpm_decode_kv_tokens": 600,
    "iterscope_fpm_prefill_length_variance": 0.0,
    "iterscope_fpm_decode_kv_tokens_variance": 25.0,
    "iterscope_fpm_queued_prefill_requests": 3,
    "iterscope_fpm_queued_prefill_tokens": 900,
    "iterscope_fpm_queued_prefill_length_variance": 0.0,
    "iterscope_fpm_queued_decode_requests": 1,
    "iterscope_fpm_queued_decode_kv_tokens": 0,
    "iterscope_fpm_queued_decode_kv_tokens_variance": 0.0,
}


def fpm_record(engine_index: int, msg_seq: int) -> IterationRecord:
    decoded = decode_frames(busy_frames(0))
    assert not isinstance(decoded, str)
    return to_record(decoded[1], engine_index, msg_seq, msg_seq - 1, 10 * S, "sglang")


def families(registry: CollectorRegistry) -> dict[str, dict[tuple, float]]:
    """{family name: {sorted labels: value}} through the text exposition and its parser."""
    text = generate_latest(registry).decode()
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def engine_values(scraped: dict, engine: str) -> dict[str, float]:
    return {
        name: value
        for name in BUSY_GAUGES
        for labels, value in scraped[name].items()
        if dict(labels)["engine"] == engine
    }


def test_an_fpm_engine_has_its_figures_as_gauges_and_our_engine_has_none():
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    send(sink, heartbeat(1, engine_index=0), fpm_record(0, 2))
    send(sink, heartbeat(1, engine_index=1), synthetic_record(1, 1, 5 * S, S))
    scraped = families(registry)
    assert {f"iterscope_{name}" for name in FPM_GAUGES} == set(BUSY_GAUGES)
    assert engine_values(scraped, "0") == BUSY_GAUGES
    assert engine_values(scraped, "1") == {}  # no series, not 0


def test_an_fpm_engine_has_no_series_of_what_fpm_does_not_say():
    """No request lifecycles, preemptions or prefix-cache hits in FPM: absent for its
    engine, where an empty histogram or a 0 would read as no request ever finishing. Our
    engine beside it has them all."""
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    send(sink, heartbeat(1, engine_index=0), fpm_record(0, 2))
    send(sink, heartbeat(1, engine_index=1), synthetic_record(1, 1, 5 * S, S))
    scraped = families(registry)
    absent = [
        *(
            f"iterscope_{name}"
            for name, bits in prometheus.UNREPORTED_HISTOGRAMS.items()
            if bits & UNKNOWN_MILESTONES
        ),
        "iterscope_requests_finished",
        "iterscope_prompt_tokens_cached",
        "iterscope_preemptions",
        "iterscope_prefix_cache_queries",
        "iterscope_prefix_cache_hits",
        "iterscope_kv_cache_usage_ratio",
    ]
    for name in absent:
        engines = {dict(labels)["engine"] for labels in scraped.get(name, {})}
        assert engines == {"1"}, name
    for name in ("iterscope_iteration_tokens", "iterscope_iteration_duration_seconds"):
        assert {dict(labels)["engine"] for labels in scraped[name]} == {"0", "1"}, name


def test_the_fpm_gauges_read_zero_once_the_producer_heartbeats_idle():
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    send(sink, heartbeat(1, engine_index=0), fpm_record(0, 2))
    send(sink, heartbeat(3, engine_index=0))  # nothing waiting or running
    assert engine_values(families(registry), "0") == dict.fromkeys(BUSY_GAUGES, 0)


def record_before_fpm() -> type[msgspec.Struct]:
    """IterationRecord as it was before its ``fpm`` field (and the fields added after it):
    what an older reader decodes."""
    fields = []
    for f in msgspec.structs.fields(IterationRecord):
        if f.name == "fpm":
            break
        if f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct(
        "OlderRecord",
        fields,
        array_like=True,
        tag=IterationRecord.__struct_config__.tag,
    )


def test_the_figures_go_through_the_lane_encoding_both_ways_of_the_schemas_age():
    record = fpm_record(0, 2)
    assert make_decoder().decode(make_encoder().encode(record)) == record
    line = msgspec.json.encode(record)
    assert msgspec.json.decode(line, type=IterationRecord) == record
    # a line from before `fpm`: without it and the fields added after it (the tag first)
    cut = 1 + IterationRecord.__struct_fields__.index("fpm")
    older = msgspec.json.encode(msgspec.json.decode(line)[:cut])
    assert msgspec.json.decode(older, type=IterationRecord).fpm is None
    read_by_older = msgspec.json.decode(line, type=record_before_fpm())  # fpm skipped
    assert read_by_older.num_kv_tokens == record.num_kv_tokens


def test_the_published_fpm_messages_counter_is_served_with_its_documented_help(tmp_path):
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    publisher = FpmPublisherSink(f"ipc://{tmp_path / 'out.sock'}", "w", 10)
    try:
        health_of(sink, [sink, publisher])
        send(publisher, heartbeat(1, engine_index=0), synthetic_record(0, 1, 5 * S, S))
        text = generate_latest(registry).decode()
    finally:
        publisher.close()
    help_text = prometheus.SIDECAR_COUNTERS["fpm_messages_published"]
    assert f"# HELP iterscope_fpm_messages_published_total {help_text}" in text
    assert 'iterscope_fpm_messages_published_total{engine="",model_name=""} 1.0' in text
    assert "iterscope_fpm_messages_published_total" in prometheus.series_names()


def test_a_replayed_fpm_recording_serves_the_same_gauges(tmp_path):
    recording = JsonlSink(str(tmp_path / "rec.jsonl"))
    ingest = Ingest([recording], live_findings=False)
    engines = FpmEngines(ingest, producer="sglang")
    for seq in range(5):
        engines.on_frames(busy_frames(seq), (seq + 1) * S)
    ingest.close()
    registry = CollectorRegistry()
    replay(tmp_path / "rec.jsonl", [PrometheusSink(registry)], live_findings=False)
    assert engine_values(families(registry), "0") == BUSY_GAUGES
