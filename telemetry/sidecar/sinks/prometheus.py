"""The Prometheus sink: per-engine state updated from records, rendered at scrape time.

    ingest thread                                   HTTP thread (per scrape)
    on_iteration / on_heartbeat                     MetricsCollector.collect()
      -> EngineMetrics: Histogram lists,              -> Gauge/Counter/HistogramMetricFamily
         milestone counters, the engine's view           built fresh from the views, the
                                                          EngineMetrics and PipelineHealth

What every sink reports of an engine is read from its view (telemetry/sidecar/engine_view.py):
the gauges, and the counters of record sums (``RecordTotals``, the same numbers the log line's
windows are differences of) and of losses, which Ingest counts. What the lane as a whole lost
is Ingest's PipelineHealth, given by ``attach``. This sink keeps only what is its own: the
histograms and the counters of request milestones.

Ingest takes no lock and touches no prometheus_client object; a scrape reads the state while
ingest may be writing it, so one scrape can mix two consecutive records (never a torn number:
every value is a single int/float/reference read under the GIL; the dicts a scrape walks are
copied first, since ingest may add an engine meanwhile). Counters only ever add the
non-negative counts a record carries, so they stay monotonic when an engine reconnects (seq
and iteration restart at 1) and when a recording is replayed into the sidecar.

The tables below (GAUGES, COUNTERS, SPEC_DECODE_COUNTERS, HISTOGRAMS, FINDING_COUNTERS,
SIDECAR_COUNTERS) name
every series this sink serves, in exposition order; ``series_names()`` lists them as PromQL
sees them, which the dashboards and alert rules are checked against
(dashboards/metric_names.py), and docs/metrics.md lists every series with the record fields
it comes from.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from telemetry.analysis.live_findings import FINDING_KINDS
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    EVENT_TTFT_SENT,
    FINISH_ABORT,
    FINISH_REASONS,
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_BLOCKS,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_MILESTONES,
    UNKNOWN_PREEMPTIONS,
    UNKNOWN_PREFIX_CACHE,
    UNKNOWN_WAITING_REASONS,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
    is_known,
)
from telemetry.sidecar.arg_types import port
from telemetry.sidecar.engine_view import EngineStatus, EngineView, kv_usage_ratio
from telemetry.sidecar.histogram import Histogram, check_bounds
from telemetry.sidecar.metrics_http import metrics_url, serve_metrics, write_metrics_url
from telemetry.sidecar.pipeline_health import PipelineHealth
from telemetry.sidecar.sink import Sink, sink_name

DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_METRICS_PORT = 9470
PREFIX = "iterscope_"
# Every series carries ``engine`` (engine index) and ``model_name`` (from the engine's
# heartbeats, "" until the first one); sidecar-level series have both empty.
LABELS = ("engine", "model_name")
WAITING_REASONS = (  # (reason label, IterationRecord field)
    ("kv_capacity", "num_waiting_kv_reqs"),
    ("seq_limit", "num_waiting_seq_limit_reqs"),
    ("token_budget", "num_waiting_budget_reqs"),
    ("other", "num_waiting_other_reqs"),  # held back by the source (vLLM: cadence, grammar)
)
# Gauges: name (after the prefix) -> (help, extra labels). Per engine, from its view, but
# the last three, which are the sidecar's own.
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "requests_running": ("Requests running (after the last iteration).", ()),
    "requests_waiting": ("Requests waiting (after the last iteration).", ()),
    "requests_waiting_by_reason": ("Waiting requests by what blocked admission.", ("reason",)),
    "kv_cache_usage_ratio": ("KV blocks used / total (0..1).", ()),
    "kv_blocks_used": ("KV-cache blocks in use.", ()),
    "kv_blocks_free": ("KV-cache blocks free.", ()),
    "kv_blocks_capacity": ("KV-cache blocks in the pool.", ()),
    "kv_tokens": ("Tokens held in the KV cache.", ()),
    "engine_state": ("1 for the engine's current state, 0 for the others.", ("state",)),
    "heartbeat_age_seconds": ("Time since the last heartbeat was received.", ()),
    "engine_info": (
        "1, with the engine's facts from its heartbeats as labels (source: "
        "iterscope, vllm-scheduler or vllm-stat-logger; version: the engine's name and "
        "version, e.g. vllm 0.32.0, empty where the source does not say).",
        ("source", "device", "pid", "version"),
    ),
    "sidecar_lag_seconds": ("Wall time at ingest - wall time the last message was sent.", ()),
    "finding_active": (
        "1 while a live finding of this kind is open on the engine, else 0 (every kind).",
        ("kind",),
    ),
    "finding_info": (
        "1 for each open live finding, with its title and the action that fixes it as labels.",
        ("kind", "title", "action"),
    ),
    "findings_window_seconds": (
        "Record time the live findings' window held at its last search: 60 s, or more while a "
        "finding is open; less once the engine's messages come faster than --findings-window "
        "holds 60 s of (what is judged on the past may then not open live).",
        (),
    ),
    "sidecar_up": ("1 while the sidecar serves this; absent when it is down.", ()),
    "sidecar_start_time_seconds": ("When the sidecar started (unix time).", ()),
    "sink_last_write_timestamp_seconds": (
        "When the sink last wrote its output successfully (unix time).",
        ("sink",),
    ),
}
# Gauges of forward-pass-metrics producers only (``iterscope sidecar --fpm``): what their
# messages say beyond the record's fields (record.FpmFigures), from the latest record; 0 once
# the engine has no work (its heartbeats say nothing is scheduled or queued); absent for the
# engines whose records carry no FPM figures. Name (after the prefix) -> (help, field).
FPM_GAUGES: dict[str, tuple[str, str]] = {
    "fpm_prefill_kv_tokens": (
        "KV tokens the scheduled prefill requests already held (prefix hits, earlier chunks).",
        "num_prefill_kv_tokens",
    ),
    "fpm_decode_kv_tokens": (
        "Context tokens (prompt and output so far) of the scheduled decode requests.",
        "num_decode_kv_tokens",
    ),
    "fpm_prefill_length_variance": (
        "Variance of the scheduled prefill requests' prompt lengths (tokens squared).",
        "var_prefill_length",
    ),
    "fpm_decode_kv_tokens_variance": (
        "Variance of the scheduled decode requests' context lengths (tokens squared).",
        "var_decode_kv_tokens",
    ),
    "fpm_queued_prefill_requests": (
        "Requests waiting for their prefill.",
        "num_queued_prefill_reqs",
    ),
    "fpm_queued_prefill_tokens": (
        "Prompt tokens of the requests waiting for their prefill.",
        "num_queued_prefill_tokens",
    ),
    "fpm_queued_prefill_length_variance": (
        "Variance of the waiting requests' prompt lengths (tokens squared).",
        "var_queued_prefill_length",
    ),
    "fpm_queued_decode_requests": (
        "Decode requests waiting to resume (preempted).",
        "num_queued_decode_reqs",
    ),
    "fpm_queued_decode_kv_tokens": (
        "Context tokens of the decode requests waiting to resume.",
        "num_queued_decode_kv_tokens",
    ),
    "fpm_queued_decode_kv_tokens_variance": (
        "Variance of the waiting decode requests' context lengths (tokens squared).",
        "var_queued_decode_kv_tokens",
    ),
}
# Bucket bounds read best as rows of numbers: left as written by the formatter.
# fmt: off
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5,
                         5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                         960.0, 1920.0, 7680.0)
_BATCH_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                        65536)
_REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                          50000, 100000, 200000, 500000, 1000000)
# Histogram name (after the prefix) -> (help, default bucket bounds). Order = exposition order.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "iteration_duration_seconds": ("Engine-core iteration time.", _ITL_BUCKETS),
    "iteration_tokens": ("Prefill + decode tokens per iteration.", _BATCH_TOKEN_BUCKETS),
    "iteration_context_tokens": ("Prefill tokens per iteration.",
                                 (0, *_BATCH_TOKEN_BUCKETS)),
    "iteration_generation_requests": ("Decode requests per iteration.",
                                      (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
    "time_to_first_token_seconds": ("Arrival to first token.",
                                    (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                     0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                                     640.0, 2560.0)),
    "inter_token_latency_seconds": ("Time between the ends of consecutive iterations, once per "
                                    "generated token.", _ITL_BUCKETS),
    "time_per_output_token_seconds": ("Decode time / (output tokens - 1), per request.",
                                      _ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival to finish.", _REQUEST_TIME_BUCKETS),
    "request_queue_time_seconds": ("Arrival to first scheduled.", _REQUEST_TIME_BUCKETS),
    "request_prefill_time_seconds": ("First scheduled to first token.", _REQUEST_TIME_BUCKETS),
    "request_decode_time_seconds": ("First token to finish.", _REQUEST_TIME_BUCKETS),
    "request_prompt_tokens": ("Prompt length of finished requests.", _REQUEST_TOKEN_BUCKETS),
    "request_generation_tokens": ("Output length of finished requests.",
                                  _REQUEST_TOKEN_BUCKETS),
    "request_preemptions": ("Preemptions per finished request.", (0, 1, 2, 3, 5, 10, 20, 50)),
}
# fmt: on
# Histograms a source may not feed (record.UNKNOWN_* bits): absent for its engines, where an
# empty series would read as requests that never came or never finished.
UNREPORTED_HISTOGRAMS = {
    "iteration_duration_seconds": UNKNOWN_ELAPSED,
    **dict.fromkeys(
        (
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
        ),
        UNKNOWN_MILESTONES,
    ),
    "request_preemptions": UNKNOWN_MILESTONES | UNKNOWN_PREEMPTIONS,
}
# Counters of an engine: name (after the prefix, without _total) -> (help, its value). The
# values are read at scrape time: record sums and losses from the engine's view (Ingest's),
# the milestone counts from this sink's EngineMetrics.
CounterValue = Callable[["EngineMetrics"], int]
COUNTERS: dict[str, tuple[str, CounterValue]] = {
    "iterations": ("Iteration records received.", lambda m: m.engine.totals.num_iterations),
    "prompt_tokens": (
        "Prefill tokens computed (prefix-cache hits are not).",
        lambda m: m.engine.totals.num_prefill_tokens,
    ),
    "prompt_tokens_cached": (
        "Prompt tokens served from the prefix cache.",
        lambda m: m.num_prompt_tokens_cached,
    ),
    "generation_tokens": (
        "Decode tokens computed (vLLM sources: tokens produced).",
        lambda m: m.engine.totals.num_decode_tokens,
    ),
    "preemptions": ("Requests preempted.", lambda m: m.engine.totals.num_preemptions),
    "kv_blocked_iterations": (
        "Iterations after which requests waited for a free KV block.",
        lambda m: m.engine.totals.num_kv_blocked_iterations,
    ),
    "prefix_cache_queries": (
        "Prefix-cache lookups, in tokens.",
        lambda m: m.engine.totals.num_prefix_query_tokens,
    ),
    "prefix_cache_hits": (
        "Prefix-cache hits, in tokens.",
        lambda m: m.engine.totals.num_prefix_hit_tokens,
    ),
    "records_received": (
        "Telemetry messages received (iterations + heartbeats).",
        lambda m: m.engine.num_messages,
    ),
    "records_dropped": (
        "Telemetry messages lost (sequence gaps).",
        lambda m: m.engine.num_dropped_total,
    ),
    "engine_index_conflicts": (
        "Times two live engine processes were seen publishing under this engine index.",
        lambda m: m.engine.num_engine_conflicts,
    ),
}
# Counters a source may not report (record.UNKNOWN_* bits): absent for its engines, not 0.
# So are the finished requests (FINISHED_COUNTER) of a source without milestones.
UNREPORTED_COUNTERS = {
    "prompt_tokens_cached": UNKNOWN_MILESTONES | UNKNOWN_PREFIX_CACHE,  # counted at milestones
    "preemptions": UNKNOWN_PREEMPTIONS,
    "kv_blocked_iterations": UNKNOWN_WAITING_REASONS,
    "prefix_cache_queries": UNKNOWN_PREFIX_CACHE,
    "prefix_cache_hits": UNKNOWN_PREFIX_CACHE,
}
# Speculative decoding's counters (record.spec_decode, from the vLLM sources), from the
# engine's RecordTotals: name (after the prefix, without _total) -> (help, RecordTotals field).
# An engine has them, and the accepted tokens by position, once its records scored a draft;
# the others (no speculative decoding: our engine, FPM producers) have no such series.
SPEC_DECODE_COUNTERS: dict[str, tuple[str, str]] = {
    "spec_decode_drafts": (
        "Speculative decoding drafts scored (one per request whose draft tokens were scored).",
        "num_drafts",
    ),
    "spec_decode_draft_tokens": ("Draft tokens scored.", "num_draft_tokens"),
    "spec_decode_accepted_tokens": ("Draft tokens accepted.", "num_accepted_tokens"),
}
SPEC_DECODE_BY_POSITION = "spec_decode_accepted_tokens_by_position"  # label position: 0, 1, ...
# Live findings' counters per engine and kind: name (after the prefix, without _total) ->
# (help, index into EngineFindings.totals[kind]).
FINDING_COUNTERS: dict[str, tuple[str, int]] = {
    "findings": ("Live findings opened.", 0),
    "finding_cost_request_seconds": (
        "Request-seconds the live findings cost (waiting, slowed or stalled; see "
        "docs/diagnosis.md), growing while they are open.",
        1,
    ),
}
# Counters with a label of their own: requests by finish reason per engine; the sidecar's.
FINISHED_COUNTER = "requests_finished"
SIDECAR_COUNTERS = {
    "frames_undecodable": "Frames that could not be decoded (unknown sender).",
    "frames_rejected": "Decoded frames that failed a check and were dropped (see docs/metrics.md).",
    "lane_disconnects": "Lane connections that ended: engines exiting, senders cut off by the "
    "size guard.",
    "lane_handshake_failures": "Peers whose ZMQ handshake failed: on a CURVE lane, engines "
    "without keys or with keys the sidecar does not trust.",
    "sink_errors": "Calls on the sink that raised (ingest went on).",
    "sink_lines_lost": "Messages the sink accepted but gave up writing.",
    "otel_spans_dropped": "Sidecar counter otel_spans_dropped.",
    "fpm_messages_published": "FPM messages handed to the --fpm-port socket (docs/fpm.md).",
}
# --vllm-compatible-names: vLLM name -> (our name, label renames). Counters without _total.
VLLM_ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "vllm:num_requests_running": ("iterscope_requests_running", {}),
    "vllm:num_requests_waiting": ("iterscope_requests_waiting", {}),
    "vllm:kv_cache_usage_perc": ("iterscope_kv_cache_usage_ratio", {}),
    "vllm:num_preemptions": ("iterscope_preemptions", {}),
    "vllm:prompt_tokens": ("iterscope_prompt_tokens", {}),
    "vllm:generation_tokens": ("iterscope_generation_tokens", {}),
    "vllm:prefix_cache_queries": ("iterscope_prefix_cache_queries", {}),
    "vllm:prefix_cache_hits": ("iterscope_prefix_cache_hits", {}),
    "vllm:request_success": ("iterscope_requests_finished", {"finish_reason": "finished_reason"}),
    "vllm:time_to_first_token_seconds": ("iterscope_time_to_first_token_seconds", {}),
    "vllm:inter_token_latency_seconds": ("iterscope_inter_token_latency_seconds", {}),
    "vllm:request_time_per_output_token_seconds": ("iterscope_time_per_output_token_seconds", {}),
    "vllm:e2e_request_latency_seconds": ("iterscope_e2e_request_latency_seconds", {}),
    "vllm:request_queue_time_seconds": ("iterscope_request_queue_time_seconds", {}),
    "vllm:request_prefill_time_seconds": ("iterscope_request_prefill_time_seconds", {}),
    "vllm:request_decode_time_seconds": ("iterscope_request_decode_time_seconds", {}),
    "vllm:request_prompt_tokens": ("iterscope_request_prompt_tokens", {}),
    "vllm:request_generation_tokens": ("iterscope_request_generation_tokens", {}),
    # vLLM's is the most tokens any of a request's n samples generated; a request here is
    # one sample (serve runs each of n choices as an engine request of its own), so it is
    # that sample's output length.
    "vllm:request_max_num_generation_tokens": ("iterscope_request_generation_tokens", {}),
    "vllm:iteration_tokens_total": ("iterscope_iteration_tokens", {}),
    "vllm:spec_decode_num_drafts": ("iterscope_spec_decode_drafts", {}),
    "vllm:spec_decode_num_draft_tokens": ("iterscope_spec_decode_draft_tokens", {}),
    "vllm:spec_decode_num_accepted_tokens": ("iterscope_spec_decode_accepted_tokens", {}),
    "vllm:spec_decode_num_accepted_tokens_per_pos": (
        "iterscope_spec_decode_accepted_tokens_by_position",
        {},
    ),
}
log = logging.getLogger(__name__)
_METRIC_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def series_names() -> set[str]:
    """Every series this sink can serve, as PromQL names it (histograms as their _bucket,
    _sum and _count series, counters with _total), without the vLLM aliases."""
    counters = {
        *COUNTERS,
        FINISHED_COUNTER,
        *SPEC_DECODE_COUNTERS,
        SPEC_DECODE_BY_POSITION,
        *SIDECAR_COUNTERS,
        *FINDING_COUNTERS,
    }
    return (
        {PREFIX + name for name in (*GAUGES, *FPM_GAUGES)}
        | {f"{PREFIX}{name}_total" for name in counters}
        | {
            f"{PREFIX}{name}_{suffix}"
            for name in HISTOGRAMS
            for suffix in ("bucket", "sum", "count")
        }
    )


def preemption_gaps_ns(milestone: RequestMilestone) -> list[int]:
    """The gap each preemption after its first token made between a finished request's
    tokens: from the start of the iteration that preempted it (its last token came at the end
    of the one before) to the end of the last prefill chunk that recomputed it, which gives
    its next token. None of these is between two iterations it decoded in, so the iteration
    intervals miss them (they were the 14 largest of a client's 2,280 intervals)."""
    bounds = [*milestone.preempted_ns, milestone.finished_ns]
    gaps = []
    for preempted_ns, next_ns in zip(bounds, bounds[1:], strict=False):
        if preempted_ns < milestone.first_token_ns:
            continue  # no token yet: no gap between tokens
        ends = [
            end for start, end, _ in milestone.prefill_chunks if preempted_ns <= start < next_ns
        ]
        if ends:
            gaps.append(max(ends) - preempted_ns)
    return gaps


class EngineMetrics:
    """What the sink keeps of one engine besides its view (telemetry/sidecar/engine_view.py,
    which the gauges, the labels, the record sums and the losses are read from): histograms
    and the counters of request milestones. Written only by the ingest thread."""

    def __init__(self, engine: EngineView, buckets: dict[str, tuple[float, ...]]) -> None:
        self.engine = engine
        self.num_prompt_tokens_cached = 0
        self.num_finished_by_reason = dict.fromkeys(FINISH_REASONS, 0)
        self.histograms = {name: Histogram(bounds) for name, bounds in buckets.items()}
        # Bound once: the per-record path then does no lookups by name.
        self._duration, self._tokens, self._prefill_tokens, self._decode_reqs = (
            self.histograms[name]
            for name in (
                "iteration_duration_seconds",
                "iteration_tokens",
                "iteration_context_tokens",
                "iteration_generation_requests",
            )
        )
        self._inter_token = self.histograms["inter_token_latency_seconds"]
        self.heartbeat_received_ns = 0  # sidecar monotonic clock, 0 = none yet
        self.lag_ns: int | None = None

    def apply_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        """Histograms and milestone counters of one record; ``engine`` is its view, before
        the record (which the view's totals take in after the sinks)."""
        self.engine = engine
        self.observe_iteration(record, engine.last_record)
        if record.first_token_latencies_ns:  # TTFTs of requests the source could not name
            for ttft_ns in record.first_token_latencies_ns:
                self.histograms["time_to_first_token_seconds"].observe(ttft_ns / 1e9)
        if record.milestones:
            for milestone in record.milestones:
                self.apply_milestone(milestone)

    def observe_iteration(self, record: IterationRecord, previous: IterationRecord | None) -> None:
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
        if num_decode_reqs and previous is not None and record.iteration == previous.iteration + 1:
            end_ns = record.start_ns + record.elapsed_ns
            previous_end_ns = previous.start_ns + previous.elapsed_ns
            if previous_end_ns and end_ns > previous_end_ns:
                self._inter_token.observe((end_ns - previous_end_ns) / 1e9, num_decode_reqs)

    def apply_milestone(self, milestone: RequestMilestone) -> None:
        """TTFT at the first-token event (unless it went out unnamed before), the rest at the
        finish (both bits may be set)."""
        histograms = self.histograms
        if milestone.event & EVENT_FIRST_TOKEN:
            if not milestone.event & EVENT_TTFT_SENT:
                histograms["time_to_first_token_seconds"].observe(
                    (milestone.first_token_ns - milestone.arrival_ns) / 1e9
                )
            self.num_prompt_tokens_cached += milestone.num_cached_tokens
        if not milestone.event & EVENT_FINISHED:
            return
        reason_index = milestone.finish_reason
        if 0 <= reason_index < len(FINISH_REASONS):
            self.num_finished_by_reason[FINISH_REASONS[reason_index]] += 1
        if reason_index == FINISH_ABORT:
            # Its client gave up (or the engine stopped it): counted by its finish reason, but
            # its times and lengths are no request's latency (vLLM records none for it either;
            # 4 clients that gave up after 3 s in a queue doubled the e2e count, QA).
            return
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
            for gap_ns in preemption_gaps_ns(milestone):  # no iteration interval holds them
                self._inter_token.observe(gap_ns / 1e9)
            if milestone.num_output_tokens > 1:
                histograms["time_per_output_token_seconds"].observe(  # ns first: 7.5 ms
                    decode_ns / (milestone.num_output_tokens - 1) / 1e9  # stays le="0.0075"
                )

    def apply_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        """Receipt and lag: the sidecar's own clocks at receipt (not the ingest clock)."""
        self.engine = engine
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
        self.health = PipelineHealth()  # Ingest's, once attached
        self.peers: list[Sink] = [self]  # every sink of the sidecar, once attached
        self.collector = MetricsCollector(self, vllm_compatible_names)
        self.registry = registry
        registry.register(self.collector)
        self.port = 0  # bound port once serving
        self.start_time = time.time()
        self._server = None

    def attach(self, health: PipelineHealth, sinks: list[Sink]) -> None:
        """Read at scrape time: the lane's losses (Ingest's), every sink's health and the
        counters they keep of their own (``sidecar_counters``)."""
        self.health = health
        self.peers = list(sinks)

    def metrics_of(self, engine_index: int, engine: EngineView) -> EngineMetrics:
        metrics = self.engines.get(engine_index)
        if metrics is None:
            metrics = self.engines[engine_index] = EngineMetrics(engine, self.buckets)
        return metrics

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        metrics = self.engines.get(record.engine_index) or self.metrics_of(
            record.engine_index, engine
        )
        metrics.apply_iteration(record, engine)

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        self.metrics_of(heartbeat.engine_index, engine).apply_heartbeat(heartbeat, engine)

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        """Its series leave the next scrape; if the index comes back its counters start
        from 0 again, a reset Prometheus' rate() already takes as a restart."""
        self.engines.pop(engine_index, None)

    def serve(self, host: str, port: int) -> int:
        """Serve the registry on http://host:port/metrics in the text format; returns the bound
        port (0 = any)."""
        self._server = serve_metrics(
            self.registry, host, port, json_routes={"/findings": self.findings_json}
        )
        self.port = self._server.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def findings_json(self) -> dict:
        """``GET /findings``: each engine's status and its live findings (open first, then
        the recently closed, newest first), for scripts and `iterscope top`."""
        engines, findings = [], []
        for index, metrics in sorted(list(self.engines.items())):
            engine = metrics.engine
            engines.append(
                {
                    "engine": index,
                    "model_name": engine.model_name,
                    "status": (engine.status or EngineStatus.IDLE).value,
                    "live_findings": engine.findings is not None,
                }
            )
            if engine.findings is not None:
                findings += [finding.to_json() for finding in engine.findings.snapshot]
        return {"engines": engines, "findings": findings}

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class MetricsCollector(Collector):
    """client_python's custom-Collector pattern: fresh metric families on every scrape."""

    def __init__(self, sink: PrometheusSink, vllm_compatible_names: bool) -> None:
        self.sink = sink
        self.vllm_compatible_names = vllm_compatible_names

    def collect(self) -> Iterator[Metric]:
        engines = [
            (metrics, [str(index), metrics.engine.model_name])
            for index, metrics in list(self.sink.engines.items())
        ]
        families = [
            *self.gauges(engines),
            *fpm_gauges(engines),
            *self.counters(engines),
            *spec_decode_counters(engines),
            *self.histograms(engines),
            *self.findings(engines),
            *self.sidecar_counters(),
            *self.sidecar_health(),
        ]
        yield from families
        if self.vllm_compatible_names:
            yield from vllm_aliases(families)

    def gauges(self, engines: list[tuple[EngineMetrics, list[str]]]) -> list[Metric]:
        """From each engine's view (its status None, not judged yet, reads as idle)."""
        now_ns = time.monotonic_ns()
        running, waiting, by_reason, usage, used, free, total, kv_tokens, state, age, info, lag = (
            gauge(name)
            for name in (
                "requests_running",
                "requests_waiting",
                "requests_waiting_by_reason",
                "kv_cache_usage_ratio",
                "kv_blocks_used",
                "kv_blocks_free",
                "kv_blocks_capacity",
                "kv_tokens",
                "engine_state",
                "heartbeat_age_seconds",
                "engine_info",
                "sidecar_lag_seconds",
            )
        )
        for metrics, labels in engines:
            engine = metrics.engine
            # A closed engine was stopped: nothing runs, waits or holds KV blocks any more
            # (its last message's figures read as 8 requests running for as long as its
            # series stayed, QA); a dead one keeps its last known, as no one knows.
            closed = engine.status is EngineStatus.CLOSED
            running.add_metric(labels, 0 if closed else engine.num_running_reqs)
            waiting.add_metric(labels, 0 if closed else engine.num_waiting_reqs)
            record = engine.last_record
            held = None if closed else record  # the figures a closed engine no longer holds
            if record is not None and not is_known(record, UNKNOWN_WAITING_REASONS):
                by_reason.add_metric([*labels, "unknown"], held.num_waiting_reqs if held else 0)
            else:
                for reason, field in WAITING_REASONS:
                    by_reason.add_metric([*labels, reason], getattr(held, field) if held else 0)
            if engine.reports(UNKNOWN_KV_BLOCKS):  # absent where the source does not say
                blocks_used, blocks_total = engine.kv_blocks()
                blocks_used = 0 if closed else blocks_used
                usage.add_metric(labels, kv_usage_ratio(blocks_used, blocks_total))
                used.add_metric(labels, blocks_used)
                free.add_metric(labels, blocks_total - blocks_used)
                total.add_metric(labels, blocks_total)
            if record is None or is_known(record, UNKNOWN_KV_TOKENS):
                kv_tokens.add_metric(labels, held.num_kv_tokens if held else 0)
            if engine.pid:
                facts = [engine.source, engine.device_name, str(engine.pid), engine.engine_version]
                info.add_metric([*labels, *facts], 1)
            current = engine.status or EngineStatus.IDLE
            for status in EngineStatus:
                state.add_metric([*labels, status.value], float(current == status))
            if metrics.heartbeat_received_ns:
                age.add_metric(labels, (now_ns - metrics.heartbeat_received_ns) / 1e9)
            if metrics.lag_ns is not None:
                lag.add_metric(labels, metrics.lag_ns / 1e9)
        return [
            running,
            waiting,
            by_reason,
            usage,
            used,
            free,
            total,
            kv_tokens,
            state,
            age,
            info,
            lag,
        ]

    def counters(self, engines: list[tuple[EngineMetrics, list[str]]]) -> Iterator[Metric]:
        for name, (documentation, value_of) in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, documentation, labels=LABELS)
            unknown_bits = UNREPORTED_COUNTERS.get(name, 0)
            for metrics, labels in engines:
                if metrics.engine.reports(unknown_bits):
                    family.add_metric(labels, value_of(metrics))
            yield family
        finished = CounterMetricFamily(
            PREFIX + FINISHED_COUNTER, "Requests finished.", labels=[*LABELS, "finish_reason"]
        )
        for metrics, labels in engines:
            if not metrics.engine.reports(UNKNOWN_MILESTONES):
                continue
            for reason, count in list(metrics.num_finished_by_reason.items()):
                finished.add_metric([*labels, reason], count)
        yield finished
        health = self.sink.health
        for name, counts in (
            ("frames_undecodable", health.num_undecodable),
            ("frames_rejected", health.num_rejected),
        ):
            family = sidecar_counter(name, ["reason"])
            for reason, count in list(counts.items()):
                family.add_metric(["", "", reason], count)
            yield family
        for name, count in (
            ("lane_disconnects", health.num_lane_disconnects),
            ("lane_handshake_failures", health.num_lane_handshake_failures),
        ):
            family = sidecar_counter(name)
            family.add_metric(["", ""], count)
            yield family

    def findings(self, engines: list[tuple[EngineMetrics, list[str]]]) -> list[Metric]:
        """Each engine's live findings (telemetry/analysis/live_findings.py), when on."""
        active, info = gauge("finding_active"), gauge("finding_info")
        window = gauge("findings_window_seconds")
        counters = {
            name: CounterMetricFamily(PREFIX + name, documentation, labels=[*LABELS, "kind"])
            for name, (documentation, _) in FINDING_COUNTERS.items()
        }
        for metrics, labels in engines:
            findings = metrics.engine.findings
            if findings is None:
                continue
            snapshot, totals = findings.snapshot, dict(findings.totals)
            window.add_metric(labels, findings.window_span_s)
            open_kinds = {f.kind for f in snapshot if not f.closed}
            for kind in FINDING_KINDS:
                active.add_metric([*labels, kind], float(kind in open_kinds))
            # one series per distinct text: two open findings alike would be a duplicate
            texts = dict.fromkeys((f.kind, f.title, f.action) for f in snapshot if not f.closed)
            for text in texts:
                info.add_metric([*labels, *text], 1)
            for name, (_, index) in FINDING_COUNTERS.items():
                for kind, values in totals.items():
                    counters[name].add_metric([*labels, kind], values[index])
        return [active, info, window, *counters.values()]

    def histograms(self, engines: list[tuple[EngineMetrics, list[str]]]) -> Iterator[Metric]:
        for name, (documentation, _) in HISTOGRAMS.items():
            family = HistogramMetricFamily(PREFIX + name, documentation, labels=LABELS)
            unknown_bits = UNREPORTED_HISTOGRAMS.get(name, 0)
            for metrics, labels in engines:
                if metrics.engine.reports(unknown_bits):
                    buckets, total_sum = metrics.histograms[name].cumulative_buckets()
                    family.add_metric(labels, buckets, total_sum)
            yield family

    def sidecar_counters(self) -> Iterator[Metric]:
        """Counters the sinks keep of their own (e.g. OTel spans dropped), summed by name."""
        values = {"otel_spans_dropped": 0.0}
        for peer in self.sink.peers:
            for key, value in peer.sidecar_counters().items():
                name = key.removeprefix(PREFIX).removesuffix("_total")
                if _METRIC_NAME.match(name):
                    values[name] = values.get(name, 0.0) + value
        for name, value in values.items():
            family = CounterMetricFamily(
                PREFIX + name, SIDECAR_COUNTERS.get(name, f"Sidecar counter {name}."), labels=LABELS
            )
            family.add_metric(["", ""], value)
            yield family

    def sidecar_health(self) -> list[Metric]:
        """The sidecar's own up and start time, and each sink's failures and last write."""
        up, started, last_write = (
            gauge(name)
            for name in (
                "sidecar_up",
                "sidecar_start_time_seconds",
                "sink_last_write_timestamp_seconds",
            )
        )
        up.add_metric(["", ""], 1.0)
        started.add_metric(["", ""], self.sink.start_time)
        errors = sidecar_counter("sink_errors", ["sink"])
        lost = sidecar_counter("sink_lines_lost", ["sink"])
        for peer in self.sink.peers:
            labels = ["", "", sink_name(peer)]
            errors.add_metric(labels, peer.num_errors)
            lost.add_metric(labels, peer.num_lines_lost)
            if peer.last_write_time:
                last_write.add_metric(labels, peer.last_write_time)
        return [up, started, errors, lost, last_write]


def fpm_gauges(engines: list[tuple[EngineMetrics, list[str]]]) -> Iterator[Metric]:
    """FPM_GAUGES, with a sample for each engine whose latest record has FPM figures."""
    reporting = []
    for metrics, labels in engines:
        engine = metrics.engine
        record = engine.last_record
        if record is not None and record.fpm is not None:
            reporting.append((record.fpm, engine.has_work, labels))
    for name, (documentation, field) in FPM_GAUGES.items():
        family = GaugeMetricFamily(PREFIX + name, documentation, labels=LABELS)
        for figures, has_work, labels in reporting:
            family.add_metric(labels, getattr(figures, field) if has_work else 0)
        yield family


def spec_decode_counters(engines: list[tuple[EngineMetrics, list[str]]]) -> Iterator[Metric]:
    """SPEC_DECODE_COUNTERS and the accepted tokens by draft position, with samples for each
    engine whose records scored a draft."""
    reporting = [
        (metrics.engine.totals, labels)
        for metrics, labels in engines
        if metrics.engine.totals.num_drafts
    ]
    for name, (documentation, field) in SPEC_DECODE_COUNTERS.items():
        family = CounterMetricFamily(PREFIX + name, documentation, labels=LABELS)
        for totals, labels in reporting:
            family.add_metric(labels, getattr(totals, field))
        yield family
    by_position = CounterMetricFamily(
        PREFIX + SPEC_DECODE_BY_POSITION,
        "Draft tokens accepted, by their position in the draft (0 = the first draft token).",
        labels=[*LABELS, "position"],
    )
    for totals, labels in reporting:
        for position, count in enumerate(totals.num_accepted_tokens_per_pos):
            by_position.add_metric([*labels, str(position)], count)
    yield by_position


def gauge(name: str) -> GaugeMetricFamily:
    """A family of GAUGES, empty."""
    documentation, extra_labels = GAUGES[name]
    return GaugeMetricFamily(PREFIX + name, documentation, labels=[*LABELS, *extra_labels])


def sidecar_counter(name: str, extra_labels: Sequence[str] = ()) -> CounterMetricFamily:
    """A family of SIDECAR_COUNTERS, empty (its samples have empty engine labels)."""
    return CounterMetricFamily(
        PREFIX + name, SIDECAR_COUNTERS[name], labels=[*LABELS, *extra_labels]
    )


def vllm_aliases(families: list[Metric]) -> Iterator[Metric]:
    """The same samples again under vLLM's names, so vLLM dashboards and alerts work. A
    family without samples gets no alias: vLLM has its speculative-decoding counters only
    where it speculates, so they appear with an engine's first draft, and an empty family
    names no series anyway."""
    by_name = {family.name: family for family in families}
    for vllm_name, (our_name, label_renames) in VLLM_ALIASES.items():
        family = by_name[our_name]
        if not family.samples:
            continue
        alias = Metric(vllm_name, family.documentation, family.type)
        for sample in family.samples:
            labels = {label_renames.get(key, key): value for key, value in sample.labels.items()}
            suffix = sample.name[len(our_name) :]
            alias.samples.append(sample._replace(name=vllm_name + suffix, labels=labels))
        yield alias


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
    group.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        help="address to serve /metrics on (default %(default)s)",
    )
    group.add_argument(
        "--metrics-port",
        type=port,
        default=DEFAULT_METRICS_PORT,
        help="port to serve /metrics on; 0 picks a free one (default %(default)s)",
    )
    group.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    group.add_argument(
        "--vllm-compatible-names",
        action="store_true",
        help="also expose vLLM's series names (vllm:num_requests_running, ...)",
    )
    group.add_argument(
        "--metrics-buckets",
        type=parse_buckets,
        action="append",
        default=[],
        metavar="HISTOGRAM=B1,B2,...",
        help="bucket bounds for one histogram (name without iterscope_); repeatable",
    )
    # How a process that started this sidecar on --metrics-port 0 learns the port it got.
    group.add_argument("--metrics-url-file", default=None, help=argparse.SUPPRESS)


def build(args: argparse.Namespace) -> PrometheusSink | None:
    """The sink, serving on --metrics-host/--metrics-port, or None with --no-metrics."""
    if args.no_metrics:
        return None
    registry = CollectorRegistry()
    sink = PrometheusSink(registry, dict(args.metrics_buckets), args.vllm_compatible_names)
    try:
        bound_port = sink.serve(args.metrics_host, args.metrics_port)
    except OSError as error:
        where = f"{args.metrics_host}:{args.metrics_port}"
        reason = error.strerror or str(error)
        raise OSError(
            f"cannot serve /metrics on {where} (--metrics-host, --metrics-port): {reason}"
        ) from None
    if args.metrics_url_file:
        write_metrics_url(args.metrics_url_file, metrics_url(args.metrics_host, bound_port))
    return sink
