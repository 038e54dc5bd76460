"""The Prometheus sink: series, values derived from records, exposition validity, flags."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
    SpecDecodeCounts,
    heartbeat,
    iteration_record,
)
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.histogram import MAX_COUNT_INDEX, Histogram
from telemetry.sidecar.metrics_http import metrics_url
from telemetry.sidecar.sink import Sink
from telemetry.sidecar.sinks import prometheus
from telemetry.sidecar.sinks.prometheus import PrometheusSink
from tests.helpers.sink_feed import conflict, health_of, lose, send, set_status

MS = 1_000_000
CONTRACT = {
    "gauge": [
        "iterscope_requests_running",
        "iterscope_requests_waiting",
        "iterscope_requests_waiting_by_reason",
        "iterscope_kv_cache_usage_ratio",
        "iterscope_kv_blocks_used",
        "iterscope_kv_blocks_free",
        "iterscope_kv_blocks_capacity",
        "iterscope_kv_tokens",
        "iterscope_engine_state",
        "iterscope_heartbeat_age_seconds",
        "iterscope_sidecar_lag_seconds",
        "iterscope_sidecar_up",
        "iterscope_sidecar_start_time_seconds",
    ],
    "counter": [
        "iterscope_iterations",
        "iterscope_prompt_tokens",
        "iterscope_prompt_tokens_cached",
        "iterscope_generation_tokens",
        "iterscope_preemptions",
        "iterscope_prefix_cache_queries",
        "iterscope_prefix_cache_hits",
        "iterscope_requests_finished",
        "iterscope_records_received",
        "iterscope_records_dropped",
        "iterscope_engine_index_conflicts",
        "iterscope_frames_undecodable",
        "iterscope_frames_rejected",
        "iterscope_lane_disconnects",
        "iterscope_otel_spans_dropped",
        "iterscope_sink_errors",
        "iterscope_sink_lines_lost",
    ],
    "histogram": [
        "iterscope_iteration_duration_seconds",
        "iterscope_iteration_tokens",
        "iterscope_iteration_context_tokens",
        "iterscope_iteration_generation_requests",
        "iterscope_time_to_first_token_seconds",
        "iterscope_inter_token_latency_seconds",
        "iterscope_time_per_output_token_seconds",
        "iterscope_e2e_request_latency_seconds",
        "iterscope_request_queue_time_seconds",
        "iterscope_request_prefill_time_seconds",
        "iterscope_request_decode_time_seconds",
        "iterscope_request_prompt_tokens",
        "iterscope_request_generation_tokens",
        "iterscope_request_preemptions",
    ],
}
ENGINE0 = {"engine": "0", "model_name": "tiny"}


def make_record(iteration: int, engine_index: int = 0, **overrides) -> IterationRecord:
    fields = dict(
        start_ns=1_000 * MS + iteration * 10 * MS,
        elapsed_ns=8 * MS,
        num_prefill_reqs=1,
        num_prefill_tokens=100,
        num_decode_reqs=4,
        num_decode_tokens=4,
        num_running_reqs=5,
        num_waiting_reqs=3,
        num_waiting_kv_reqs=2,
        num_waiting_seq_limit_reqs=1,
        num_kv_blocks_used=25,
        num_kv_blocks_free=75,
        num_kv_tokens=390,
        num_prefix_query_tokens=100,
        num_prefix_hit_tokens=32,
        num_preemptions=1,
    )
    return iteration_record(engine_index, iteration, iteration, **{**fields, **overrides})


def make_heartbeat(
    engine_index: int = 0, pid: int = 42, ts_ns: int = 500 * MS, **overrides
) -> Heartbeat:
    fields = dict(
        model_name="tiny",
        device_name="CPU",
        block_size=16,
        num_kv_blocks_total=100,
        pid=pid,
    )
    return heartbeat(engine_index, 0, ts_ns, 1_700_000_000 * 10**9, **{**fields, **overrides})


def make_milestone(event: int, **overrides) -> RequestMilestone:
    fields = dict(
        request_id="r1",
        event=event,
        arrival_ns=1_000 * MS,
        first_scheduled_ns=1_050 * MS,
        first_token_ns=1_250 * MS,
        finished_ns=3_250 * MS,
        num_prompt_tokens=300,
        num_cached_tokens=64,
        num_output_tokens=11,
        num_preemptions=2,
        finish_reason=1,
    )
    fields.update(overrides)
    return RequestMilestone(**fields)


def new_sink(**kwargs) -> tuple[PrometheusSink, CollectorRegistry]:
    registry = CollectorRegistry()
    return PrometheusSink(registry, **kwargs), registry


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value}, through the text exposition and its parser."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({**ENGINE0, **labels}.items()))]


def histogram_count(samples: dict, name: str, le: str = "+Inf") -> float:
    return value(samples, name + "_bucket", le=le)


def test_every_contract_series_has_type_and_engine_labels():
    sink, registry = new_sink()
    send(sink, make_heartbeat())
    send(sink, make_record(1))
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    for metric_type, names in CONTRACT.items():
        for name in names:
            assert families[name].type == metric_type, name
            assert families[name].samples, name
    for family in families.values():
        for sample in family.samples:
            assert {"engine", "model_name"} <= set(sample.labels), sample


def test_gauges_and_counters_follow_records():
    sink, registry = new_sink()
    send(sink, make_heartbeat())
    send(sink, make_record(1))
    send(sink, make_record(2, num_kv_blocks_used=40, num_kv_blocks_free=60))
    set_status(sink, 0, EngineStatus.RUNNING, 0)
    lose(sink, 0, 3)
    conflict(sink, 0, (100, 200))
    samples = scrape(registry)
    assert value(samples, "iterscope_engine_index_conflicts_total") == 1
    assert value(samples, "iterscope_requests_running") == 5
    assert value(samples, "iterscope_requests_waiting") == 3
    assert value(samples, "iterscope_requests_waiting_by_reason", reason="kv_capacity") == 2
    assert value(samples, "iterscope_requests_waiting_by_reason", reason="seq_limit") == 1
    assert value(samples, "iterscope_kv_cache_usage_ratio") == pytest.approx(0.4)
    assert value(samples, "iterscope_kv_blocks_used") == 40
    assert value(samples, "iterscope_kv_blocks_free") == 60
    assert value(samples, "iterscope_kv_blocks_capacity") == 100
    assert value(samples, "iterscope_kv_tokens") == 390
    assert value(samples, "iterscope_engine_state", state="running") == 1
    assert value(samples, "iterscope_engine_state", state="idle") == 0
    assert value(samples, "iterscope_iterations_total") == 2
    assert value(samples, "iterscope_prompt_tokens_total") == 200
    assert value(samples, "iterscope_generation_tokens_total") == 8
    assert value(samples, "iterscope_preemptions_total") == 2
    assert value(samples, "iterscope_prefix_cache_queries_total") == 200
    assert value(samples, "iterscope_prefix_cache_hits_total") == 64
    assert value(samples, "iterscope_records_received_total") == 3  # 2 records + 1 heartbeat
    assert value(samples, "iterscope_records_dropped_total") == 3
    assert histogram_count(samples, "iterscope_iteration_duration_seconds", le="0.0075") == 0
    assert histogram_count(samples, "iterscope_iteration_duration_seconds", le="0.01") == 2
    assert value(samples, "iterscope_iteration_tokens_sum") == 208


def test_kv_blocked_iterations_count_every_iteration_that_left_requests_waiting_for_kv():
    """Counted per record, not sampled: the saturation alert's rate() sees every iteration,
    however the waiting_by_reason gauge flaps between scrapes."""
    sink, registry = new_sink()
    send(sink, make_heartbeat())
    blocked = dict(num_waiting_reqs=3, num_waiting_kv_reqs=3, num_waiting_seq_limit_reqs=0)
    seq_limited = dict(num_waiting_reqs=3, num_waiting_kv_reqs=0, num_waiting_seq_limit_reqs=3)
    nobody_waits = dict(num_waiting_reqs=0, num_waiting_kv_reqs=0, num_waiting_seq_limit_reqs=0)
    for iteration, fields in enumerate(
        (blocked, seq_limited, blocked, nobody_waits, blocked, seq_limited), start=1
    ):
        send(sink, make_record(iteration, **fields))
    samples = scrape(registry)
    assert value(samples, "iterscope_kv_blocked_iterations_total") == 3
    assert value(samples, "iterscope_iterations_total") == 6
    assert value(samples, "iterscope_requests_waiting_by_reason", reason="kv_capacity") == 0


def test_queues_and_kv_total_follow_latest_message():
    sink, registry = new_sink()
    send(sink, make_heartbeat(num_running_reqs=9, num_kv_blocks_total=120))
    samples = scrape(registry)
    assert value(samples, "iterscope_requests_running") == 9
    assert value(samples, "iterscope_kv_blocks_capacity") == 120
    assert value(samples, "iterscope_kv_blocks_free") == 120
    send(sink, make_record(1))
    samples = scrape(registry)
    assert value(samples, "iterscope_requests_running") == 5
    assert value(samples, "iterscope_kv_blocks_capacity") == 100  # used + free, as the log line
    send(sink, make_heartbeat(num_running_reqs=0, num_waiting_reqs=7))
    samples = scrape(registry)
    assert value(samples, "iterscope_requests_running") == 0
    assert value(samples, "iterscope_requests_waiting") == 7


def test_engine_info_labels_the_source_device_pid_and_engine_version():
    sink, registry = new_sink()
    beat = make_heartbeat(pid=42, source="vllm-stat-logger", engine_version="vllm 0.34.0")
    send(sink, beat)
    info = {
        "source": "vllm-stat-logger",
        "device": beat.device_name,
        "pid": "42",
        "version": "vllm 0.34.0",
    }
    assert value(scrape(registry), "iterscope_engine_info", **info) == 1


def test_a_restarted_engine_shows_no_kv_state_of_the_old_process():
    sink, registry = new_sink()
    send(sink, make_heartbeat(pid=42))
    send(sink, make_record(1, num_kv_blocks_used=97, num_kv_blocks_free=3))
    assert value(scrape(registry), "iterscope_kv_cache_usage_ratio") == pytest.approx(0.97)
    send(sink, make_heartbeat(pid=43, num_kv_blocks_total=200))  # the new process
    samples = scrape(registry)
    assert value(samples, "iterscope_kv_cache_usage_ratio") == 0
    assert value(samples, "iterscope_kv_blocks_capacity") == 200
    assert value(samples, "iterscope_iterations_total") == 1  # counters carry on
    send(sink, make_record(1, num_kv_blocks_used=20, num_kv_blocks_free=180))
    assert value(scrape(registry), "iterscope_kv_cache_usage_ratio") == pytest.approx(0.1)


def test_lifecycle_histograms_from_one_milestone_with_both_events():
    sink, registry = new_sink()
    send(sink, make_heartbeat())
    milestone = make_milestone(EVENT_FIRST_TOKEN | EVENT_FINISHED)
    send(sink, make_record(1, milestones=[milestone]))
    samples = scrape(registry)
    expected_sums = {
        "iterscope_time_to_first_token_seconds": 0.25,
        "iterscope_e2e_request_latency_seconds": 2.25,
        "iterscope_request_queue_time_seconds": 0.05,
        "iterscope_request_prefill_time_seconds": 0.2,
        "iterscope_request_decode_time_seconds": 2.0,
        "iterscope_time_per_output_token_seconds": 0.2,  # 2.0 s / (11 - 1)
        "iterscope_request_prompt_tokens": 300,
        "iterscope_request_generation_tokens": 11,
        "iterscope_request_preemptions": 2,
    }
    for name, expected in expected_sums.items():
        assert value(samples, name + "_count") == 1, name
        assert value(samples, name + "_sum") == pytest.approx(expected), name
    assert histogram_count(samples, "iterscope_time_to_first_token_seconds", le="0.1") == 0
    assert histogram_count(samples, "iterscope_time_to_first_token_seconds", le="0.25") == 1
    assert value(samples, "iterscope_requests_finished_total", finish_reason="length") == 1
    assert value(samples, "iterscope_requests_finished_total", finish_reason="stop") == 0
    assert value(samples, "iterscope_prompt_tokens_cached_total") == 64


def test_first_token_and_finish_in_separate_iterations_count_once():
    sink, registry = new_sink()
    send(sink, make_record(1, milestones=[make_milestone(EVENT_FIRST_TOKEN)]))
    samples = scrape(registry)
    assert value(samples, "iterscope_time_to_first_token_seconds_count", model_name="") == 1
    assert value(samples, "iterscope_e2e_request_latency_seconds_count", model_name="") == 0
    send(sink, make_record(2, milestones=[make_milestone(EVENT_FINISHED)]))
    samples = scrape(registry)
    assert value(samples, "iterscope_time_to_first_token_seconds_count", model_name="") == 1
    assert value(samples, "iterscope_e2e_request_latency_seconds_count", model_name="") == 1
    assert value(samples, "iterscope_prompt_tokens_cached_total", model_name="") == 64


@pytest.mark.parametrize("first_token", [False, True], ids=["while-waiting", "while-decoding"])
def test_an_aborted_request_is_counted_by_its_reason_and_in_no_request_histogram(first_token):
    """A client that gave up (4 did, after 3 s in a queue, on a real vLLM): counted as
    finished with reason abort, observed in none of the finish's histograms, as vLLM records
    nothing for it (the e2e count was twice vLLM's); a first token it had is a TTFT still."""
    sink, registry = new_sink()
    fields = {} if first_token else {"first_scheduled_ns": 0, "first_token_ns": 0}
    event = EVENT_FINISHED | (EVENT_FIRST_TOKEN if first_token else 0)
    aborted = make_milestone(event, num_output_tokens=5 * first_token, finish_reason=2, **fields)
    send(sink, make_record(1, milestones=[aborted]))
    samples = scrape(registry)
    labels = {"model_name": ""}
    for name in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_preemptions",
    ):
        assert value(samples, f"iterscope_{name}_count", **labels) == 0, name
    assert value(samples, "iterscope_time_to_first_token_seconds_count", **labels) == first_token
    assert value(samples, "iterscope_requests_finished_total", finish_reason="abort", **labels) == 1


def test_inter_token_latency_weighted_and_only_across_consecutive_iterations():
    sink, registry = new_sink()
    send(sink, make_record(1))  # no previous iteration: no interval
    send(sink, make_record(2, num_decode_reqs=4))  # 10 ms after iteration 1, x4
    send(sink, make_record(5, num_decode_reqs=3))  # gap: iterations 3, 4 lost
    send(sink, make_record(6, num_decode_reqs=0))  # nothing decoded
    samples = scrape(registry)
    labels = {"model_name": ""}
    assert value(samples, "iterscope_inter_token_latency_seconds_count", **labels) == 4
    assert value(samples, "iterscope_inter_token_latency_seconds_sum", **labels) == pytest.approx(
        0.04
    )


def test_a_preempted_request_s_gap_between_tokens_is_an_inter_token_interval():
    """Preempted after its first token at 1.5 s, recomputed in chunks ending 2.1 s and 2.4 s:
    its next token came 0.9 s after the one before, an interval no pair of iterations it
    decoded in holds (a client saw 14 such, the largest, that /metrics left out). A
    preemption before its first token (1.1 s) is no gap between tokens."""
    sink, registry = new_sink()
    finished = make_milestone(
        EVENT_FINISHED,
        preempted_ns=[1_100 * MS, 1_500 * MS],
        prefill_chunks=[
            (1_060 * MS, 1_090 * MS, 300),
            (1_200 * MS, 1_250 * MS, 300),
            (1_600 * MS, 2_100 * MS, 256),
            (2_100 * MS, 2_400 * MS, 60),
        ],
    )
    send(sink, make_record(1, milestones=[finished]))
    samples = scrape(registry)
    labels = {"model_name": ""}
    assert value(samples, "iterscope_inter_token_latency_seconds_count", **labels) == 1
    assert value(samples, "iterscope_inter_token_latency_seconds_sum", **labels) == pytest.approx(
        0.9
    )


def counter_like_values(samples: dict) -> dict:
    """Every sample that must never decrease: counters and histogram buckets/counts/sums."""
    return {
        key: val
        for key, val in samples.items()
        if key[0].endswith(("_total", "_bucket", "_count", "_sum"))
    }


def test_counters_monotonic_across_engine_restart_and_replay():
    sink, registry = new_sink()
    first_life = [make_heartbeat(pid=1)] + [
        make_record(i, milestones=[make_milestone(3)] if i % 3 == 0 else []) for i in range(1, 8)
    ]
    # The engine restarts: new pid, seq and iteration from 1, clocks from elsewhere.
    second_life = [make_heartbeat(pid=2, ts_ns=5 * MS)] + [
        make_record(i, start_ns=i * MS, num_prefill_tokens=7) for i in range(1, 5)
    ]
    # Then the sidecar is fed a recording of the first life again (replay).
    previous = {}
    for message in first_life + second_life + first_life:
        if isinstance(message, Heartbeat):
            send(sink, message)
        else:
            send(sink, message)
        current = counter_like_values(scrape(registry))
        for key, old in previous.items():
            assert current[key] >= old, key
        previous = current
    assert value(scrape(registry), "iterscope_iterations_total") == 7 + 4 + 7
    assert value(scrape(registry), "iterscope_prompt_tokens_total") == 2 * 7 * 100 + 4 * 7


def test_sidecar_level_series_use_empty_engine_labels():
    sink, registry = new_sink()

    class FakeOtelSink(Sink):
        def sidecar_counters(self) -> dict[str, float]:
            return {"otel_spans_dropped": 5.0}

    health = health_of(sink, [sink, FakeOtelSink()])
    health.num_undecodable["malformed"] += 2
    samples = scrape(registry)
    empty = {"engine": "", "model_name": ""}
    assert (
        samples[
            (
                "iterscope_frames_undecodable_total",
                frozenset({**empty, "reason": "malformed"}.items()),
            )
        ]
        == 2
    )
    assert (
        samples[
            (
                "iterscope_frames_undecodable_total",
                frozenset({**empty, "reason": "version"}.items()),
            )
        ]
        == 0
    )
    assert samples[("iterscope_otel_spans_dropped_total", frozenset(empty.items()))] == 5


def test_two_engines_are_separate_series():
    sink, registry = new_sink()
    send(sink, make_heartbeat(engine_index=0))
    send(sink, make_heartbeat(engine_index=1, model_name="tiny"))
    send(sink, make_record(1, engine_index=0))
    send(sink, make_record(1, engine_index=1))
    send(sink, make_record(2, engine_index=1))
    samples = scrape(registry)
    assert value(samples, "iterscope_iterations_total") == 1
    assert value(samples, "iterscope_iterations_total", engine="1") == 2


def run_promtool(text: str) -> str:
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    return result.stdout + result.stderr


def busy_exposition(**kwargs) -> str:
    sink, registry = new_sink(**kwargs)
    send(sink, make_heartbeat())
    send(sink, make_record(1, milestones=[make_milestone(3)]))
    send(sink, make_record(2))
    health_of(sink).num_undecodable["version"] += 1
    return generate_latest(registry).decode()


def lint_problems(text: str) -> set[str]:
    output = run_promtool(text)
    return {line.strip() for line in output.splitlines() if line.strip()}


@pytest.mark.live
def test_exposition_passes_promtool_check_metrics():
    assert lint_problems(busy_exposition()) == set()


@pytest.mark.live
def test_promtool_reports_a_broken_exposition():
    """The check above would catch a real problem (guards against promtool never failing)."""
    broken = busy_exposition() + "# TYPE iterscope_bad_total gauge\niterscope_bad_total 1\n"
    assert any("iterscope_bad_total" in line for line in lint_problems(broken))


@pytest.mark.live
def test_vllm_compatible_names():
    text = busy_exposition(vllm_compatible_names=True)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, metric_type in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:num_preemptions", "counter"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:request_queue_time_seconds", "histogram"),
        ("vllm:request_prefill_time_seconds", "histogram"),
        ("vllm:request_decode_time_seconds", "histogram"),
        ("vllm:iteration_tokens_total", "histogram"),
    ]:
        assert families[name].type == metric_type, name
    success = {
        sample.labels["finished_reason"]: sample.value
        for sample in families["vllm:request_success"].samples
    }
    assert success == {"stop": 0, "length": 1, "abort": 0, "error": 0, "repetition": 0}
    ours = {
        s.labels["finish_reason"]: s.value for s in families["iterscope_requests_finished"].samples
    }
    assert success == ours
    usage = families["vllm:kv_cache_usage_perc"].samples[0]
    assert usage.value == pytest.approx(0.25) and usage.labels == ENGINE0
    # One sample per request here, so vLLM's "most tokens among the n samples" is the length.
    longest = families["vllm:request_max_num_generation_tokens"]
    lengths = families["iterscope_request_generation_tokens"]
    assert longest.type == "histogram"
    assert samples_by_suffix(longest) == samples_by_suffix(lengths)
    assert {suffix: value for suffix, _, value in samples_by_suffix(lengths)}["_count"] == 1
    # Colons are vLLM's convention; promtool flags only those (and vLLM's own _total histogram).
    for line in lint_problems(text):
        assert line.startswith("vllm:") and ("':'" in line or "_total" in line), line
    assert "vllm:" not in busy_exposition()


def samples_by_suffix(family) -> list[tuple[str, dict, float]]:
    """(suffix such as "_bucket", labels, value) of each sample: the family without its name."""
    return [(s.name.removeprefix(family.name), s.labels, s.value) for s in family.samples]


def parse_flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    prometheus.add_arguments(parser)
    return parser.parse_args(argv)


def test_build_serves_metrics_over_http():
    args = parse_flags(["--metrics-port", "0", "--metrics-buckets", "iteration_tokens=1,10,100"])
    sink = prometheus.build(args)
    try:
        assert sink.port > 0
        send(sink, make_record(1))
        url = f"http://127.0.0.1:{sink.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert 'iterscope_iterations_total{engine="0",model_name=""} 1.0' in text
        assert 'iterscope_iteration_tokens_bucket{engine="0",le="10.0",model_name=""}' in text
    finally:
        sink.close()


def test_the_sidecar_writes_the_url_it_serves_metrics_on(tmp_path):
    """A process that started it on port 0 reads the bound port from --metrics-url-file."""
    url_file = tmp_path / "metrics_url"
    sink = prometheus.build(
        parse_flags(["--metrics-port", "0", "--metrics-url-file", str(url_file)])
    )
    try:
        url = url_file.read_text().strip()
        assert url == f"http://127.0.0.1:{sink.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert b"iterscope_iterations_total" in response.read()
    finally:
        sink.close()
    assert (
        prometheus.build(
            parse_flags(["--no-metrics", "--metrics-url-file", str(tmp_path / "none")])
        )
        is None
    )
    assert not (tmp_path / "none").exists()
    assert metrics_url("0.0.0.0", 9) == "http://127.0.0.1:9/metrics"
    assert metrics_url("::", 9) == "http://[::1]:9/metrics"
    assert metrics_url("fe80::1", 9) == "http://[fe80::1]:9/metrics"
    assert metrics_url("10.0.0.2", 9) == "http://10.0.0.2:9/metrics"


def test_vllm_names_keep_their_colon_whatever_format_the_scraper_asks_for():
    """Prometheus asks for OpenMetrics first; prometheus_client's OpenMetrics writer would turn
    vllm:num_requests_running into vllm_num_requests_running."""
    sink = prometheus.build(parse_flags(["--metrics-port", "0", "--vllm-compatible-names"]))
    try:
        send(sink, make_record(1))
        prometheus_accept = (
            "application/openmetrics-text;version=1.0.0,"
            "application/openmetrics-text;version=0.0.1;q=0.75,"
            "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        )
        for accept in (prometheus_accept, "text/plain;version=1.0.0;escaping=underscores", ""):
            request = urllib.request.Request(
                f"http://127.0.0.1:{sink.port}/metrics",
                headers={"Accept": accept} if accept else {},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = response.read().decode()
            assert 'vllm:num_requests_running{engine="0",model_name=""} 5.0' in text, accept
            assert "vllm_num_requests_running" not in text
            assert "# EOF" not in text  # not OpenMetrics
    finally:
        sink.close()


def test_flags_defaults_no_metrics_and_bad_buckets(capsys):
    args = parse_flags([])
    assert args.metrics_host == "127.0.0.1" and not args.vllm_compatible_names
    assert prometheus.build(parse_flags(["--no-metrics"])) is None
    for bad in [
        "nonexistent=1,2",
        "iteration_tokens=2,1",
        "iteration_tokens=1,x",
        "iteration_tokens",
    ]:
        with pytest.raises(SystemExit):
            parse_flags(["--metrics-buckets", bad])
        assert "--metrics-buckets" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown histogram"):
        new_sink(buckets={"nope": (1.0,)})


def test_docs_list_every_series():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    text = busy_exposition(vllm_compatible_names=True)
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}" in docs, name


def test_docs_name_only_series_the_sidecar_or_the_api_port_serves():
    """docs/metrics.md and the sink's own table (its series_names) are the same contract."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    served = prometheus.series_names() | {"iterscope_api_sidecar_reachable"}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in served} | served
    named = set(re.findall(r"`(iterscope_[a-z0-9_]+)", docs))
    assert named and named <= families, named - families


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["record", "heartbeat", "restart", "dropped", "status"]),
            st.integers(0, 1),
            st.integers(0, 600),
            st.integers(0, 3),
        ),
        max_size=25,
    )
)
def test_counters_never_decrease_whatever_the_message_order(events):
    """Any mix of records (with gaps), heartbeats, engine restarts, drops and status changes.

    Samples are compared per engine: model_name is "" until the engine's first heartbeat."""
    sink, registry = new_sink()
    iterations = {0: 0, 1: 0}
    pids = {0: 1, 1: 1}
    previous: dict = {}
    for kind, engine, amount, event in events:
        if kind == "record":
            iterations[engine] += 1 + amount % 3  # sometimes skips iterations (lost records)
            milestones = [make_milestone(event, finish_reason=amount % 4 - 1)] if event else []
            send(
                sink,
                make_record(
                    iterations[engine],
                    engine_index=engine,
                    num_prefill_tokens=amount,
                    milestones=milestones,
                ),
            )
        elif kind == "restart":
            iterations[engine] = 0
            pids[engine] += 1
            send(sink, make_heartbeat(engine, pid=pids[engine], ts_ns=amount * MS))
        elif kind == "heartbeat":
            send(sink, make_heartbeat(engine, pid=pids[engine]))
        elif kind == "dropped":
            lose(sink, engine, amount)
        else:
            set_status(sink, engine, list(EngineStatus)[event], 0)
        current = {
            (name, frozenset((k, v) for k, v in labels if k != "model_name")): val
            for (name, labels), val in counter_like_values(scrape(registry)).items()
        }
        assert all(current[key] >= old for key, old in previous.items())
        previous = current


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-10.0, 70_000.0, allow_nan=False), min_size=1, max_size=8, unique=True),
    st.lists(st.integers(0, 2 * MAX_COUNT_INDEX), max_size=30),
)
def test_observe_count_buckets_as_observe(bounds, counts):
    """The lookup table agrees with the bisect on every int, on and around every bound."""
    bounds = sorted(bounds)
    edges = [n for bound in bounds for n in (int(bound) - 1, int(bound), int(bound) + 1) if n >= 0]
    by_lookup, by_bisect = Histogram(bounds), Histogram(bounds)
    for count in [*counts, *edges, 0, MAX_COUNT_INDEX - 1, MAX_COUNT_INDEX]:
        by_lookup.observe_count(count)
        by_bisect.observe(count)
    assert by_lookup.bucket_counts == by_bisect.bucket_counts
    assert by_lookup.sum == by_bisect.sum


def test_iteration_histograms_edge_buckets():
    """Per-iteration observations (inlined in the sink) land where Histogram.observe puts them:
    values on a bound (le is inclusive), just past it, zero, and past the last bound."""
    sink, _ = new_sink(buckets={"iteration_tokens": (0.5, 8, 16.5, 1000)})
    reference = {
        name: Histogram(sink.buckets[name])
        for name in (
            "iteration_duration_seconds",
            "iteration_tokens",
            "iteration_context_tokens",
            "iteration_generation_requests",
            "inter_token_latency_seconds",
        )
    }
    cases = [
        (0, 0, 0),
        (8, 0, 8 * MS),
        (8, 1, 10 * MS),
        (16, 16, 10 * MS + 1),
        (17, 32, 1),
        (65536, 1024, 5 * MS),
        (65537, 1025, 80 * 10**9),
        (10**6, 0, 81 * 10**9),
    ]
    end_ns = 0
    for iteration, (context_tokens, generation_reqs, elapsed_ns) in enumerate(cases, start=1):
        start_ns = end_ns + 2 * MS
        send(
            sink,
            make_record(
                iteration,
                start_ns=start_ns,
                elapsed_ns=elapsed_ns,
                num_prefill_tokens=context_tokens,
                num_decode_reqs=generation_reqs,
                num_decode_tokens=generation_reqs,
            ),
        )
        reference["iteration_duration_seconds"].observe(elapsed_ns / 1e9)
        reference["iteration_tokens"].observe(context_tokens + generation_reqs)
        reference["iteration_context_tokens"].observe(context_tokens)
        reference["iteration_generation_requests"].observe(generation_reqs)
        if generation_reqs and iteration > 1:
            reference["inter_token_latency_seconds"].observe(
                (start_ns + elapsed_ns - end_ns) / 1e9, generation_reqs
            )
        end_ns = start_ns + elapsed_ns
    for name, expected in reference.items():
        observed = sink.engines[0].histograms[name]
        assert observed.cumulative_buckets() == expected.cumulative_buckets(), name


def test_time_per_output_token_on_a_bound_lands_in_that_bucket():
    """67.5 ms over 9 intervals is exactly 7.5 ms: le="0.0075", not the next bucket (dividing
    the seconds instead of the nanoseconds rounded it past the bound)."""
    sink, registry = new_sink()
    send(sink, make_heartbeat())
    finished = make_milestone(
        EVENT_FINISHED,
        first_token_ns=1_000 * MS,
        finished_ns=1_000 * MS + 67_500_000,
        num_output_tokens=10,
    )
    send(sink, make_record(1, milestones=[finished]))
    samples = scrape(registry)
    assert histogram_count(samples, "iterscope_time_per_output_token_seconds", le="0.0075") == 1


def test_le_labels_are_spelled_as_prometheus_client_spells_them():
    """Above 1e5 prometheus_client (so vLLM) writes 1e+06; a fleet mixing both must not split
    one bucket into two series."""
    from prometheus_client import Histogram as ClientHistogram

    bounds = (0.005, 1.0, 2560.0, 500000.0, 1e6)
    client_registry = CollectorRegistry()
    ClientHistogram("reference", "", buckets=bounds, registry=client_registry)
    expected = [
        sample.labels["le"]
        for family in client_registry.collect()
        for sample in family.samples
        if sample.name.endswith("_bucket")
    ]
    sink, registry = new_sink(buckets={"request_prompt_tokens": bounds})
    send(sink, make_heartbeat())
    text = generate_latest(registry).decode()
    ours = re.findall(r'iterscope_request_prompt_tokens_bucket\{[^}]*le="([^"]+)"', text)
    assert ours == expected == ["0.005", "1.0", "2560.0", "500000.0", "1e+06", "+Inf"]


def spec_decode(num_drafts: int, num_draft_tokens: int, per_pos: list[int]) -> SpecDecodeCounts:
    """What vLLM's scheduler counts in one step: drafts scored, accepted tokens by position."""
    return SpecDecodeCounts(num_drafts, num_draft_tokens, sum(per_pos), per_pos)


SPEC_DECODE_SERIES = (
    "iterscope_spec_decode_drafts_total",
    "iterscope_spec_decode_draft_tokens_total",
    "iterscope_spec_decode_accepted_tokens_total",
    "iterscope_spec_decode_accepted_tokens_by_position_total",
)


def spec_decode_samples(samples: dict) -> dict:
    return {key: v for key, v in samples.items() if key[0].startswith("iterscope_spec_decode")}


def test_spec_decode_counters_sum_the_drafts_of_the_records_that_scored_some():
    sink, registry = new_sink()
    send(sink, make_heartbeat())
    send(sink, make_record(1))  # no draft scored: spec_decode None
    assert spec_decode_samples(scrape(registry)) == {}
    send(sink, make_record(2, spec_decode=spec_decode(3, 9, [3, 2, 1])))
    send(sink, make_record(3))
    send(sink, make_record(4, spec_decode=spec_decode(2, 6, [2, 0, 0])))
    send(sink, make_record(5, spec_decode=spec_decode(1, 4, [1, 1, 1, 1])))  # a longer draft
    samples = scrape(registry)
    assert value(samples, "iterscope_spec_decode_drafts_total") == 6
    assert value(samples, "iterscope_spec_decode_draft_tokens_total") == 19
    assert value(samples, "iterscope_spec_decode_accepted_tokens_total") == 12
    by_position = {
        dict(labels)["position"]: v
        for (name, labels), v in samples.items()
        if name == "iterscope_spec_decode_accepted_tokens_by_position_total"
    }
    assert by_position == {"0": 6, "1": 3, "2": 2, "3": 1}
    assert value(samples, "iterscope_iterations_total") == 5


def test_spec_decode_series_are_absent_for_an_engine_that_scored_no_draft():
    """Engine 1 decodes without speculative decoding: no spec series of it, not 0; the
    families are still declared (HELP and TYPE), as the FPM gauges are."""
    sink, registry = new_sink()
    send(sink, make_heartbeat(engine_index=0), make_heartbeat(engine_index=1))
    send(sink, make_record(1, engine_index=0, spec_decode=spec_decode(4, 8, [3, 1])))
    send(sink, make_record(1, engine_index=1))
    samples = spec_decode_samples(scrape(registry))
    assert {dict(labels)["engine"] for _, labels in samples} == {"0"}
    assert len(samples) == 5  # three counters and two positions, of engine 0
    declared = {
        family.name: family.type
        for family in text_string_to_metric_families(generate_latest(new_sink()[1]).decode())
    }
    for name in SPEC_DECODE_SERIES:
        assert declared[name.removesuffix("_total")] == "counter", name


def test_spec_decode_counters_under_vllms_names():
    """vLLM's SpecDecodingProm names, its label names (position beside engine and
    model_name), the same values; declared only once a draft was scored, as vLLM declares
    them only where it speculates."""
    sink, registry = new_sink(vllm_compatible_names=True)
    send(sink, make_heartbeat(), make_record(1))
    declared = {
        family.name for family in text_string_to_metric_families(generate_latest(registry).decode())
    }
    assert "vllm:num_requests_running" in declared
    assert not {name for name in declared if name.startswith("vllm:spec_decode")}
    send(sink, make_record(2, spec_decode=spec_decode(5, 15, [4, 3, 1])))
    samples = scrape(registry)
    for vllm_name, ours in [
        ("vllm:spec_decode_num_drafts_total", "iterscope_spec_decode_drafts_total"),
        ("vllm:spec_decode_num_draft_tokens_total", "iterscope_spec_decode_draft_tokens_total"),
        (
            "vllm:spec_decode_num_accepted_tokens_total",
            "iterscope_spec_decode_accepted_tokens_total",
        ),
    ]:
        assert value(samples, vllm_name) == value(samples, ours), vllm_name
    assert value(samples, "vllm:spec_decode_num_drafts_total") == 5
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total") == 8
    theirs, ours = (
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "iterscope_spec_decode_accepted_tokens_by_position_total",
    )
    for position, count in enumerate([4, 3, 1]):
        assert value(samples, theirs, position=str(position)) == count
        assert value(samples, ours, position=str(position)) == count


@pytest.mark.live
def test_spec_decode_exposition_passes_promtool_check_metrics():
    sink, registry = new_sink()
    send(sink, make_heartbeat())
    send(sink, make_record(1, spec_decode=spec_decode(3, 9, [3, 2, 1])))
    text = generate_latest(registry).decode()
    assert "iterscope_spec_decode_accepted_tokens_by_position_total{" in text
    assert lint_problems(text) == set()


def test_a_closed_engine_holds_no_requests_and_no_kv_blocks():
    """vLLM stopped under load: its closing heartbeat says 5 running, cut off by the
    shutdown. Closed, nothing runs, waits or holds KV any more (the gauges read 8 running
    and 11% KV for as long as the series stayed, QA); the state says closed."""
    sink, registry = new_sink()
    send(sink, make_heartbeat(), make_record(1))
    send(sink, make_heartbeat(ts_ns=700 * MS, closing=True, stop_requested=True))
    set_status(sink, 0, EngineStatus.CLOSED, 700 * MS)
    samples = scrape(registry)
    assert value(samples, "iterscope_engine_state", state="closed") == 1
    for name in ("iterscope_requests_running", "iterscope_requests_waiting"):
        assert value(samples, name) == 0, name
    assert value(samples, "iterscope_requests_waiting_by_reason", reason="kv_capacity") == 0
    assert value(samples, "iterscope_kv_cache_usage_ratio") == 0
    assert value(samples, "iterscope_kv_blocks_free") == 100
