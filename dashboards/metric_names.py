"""The metric names the dashboards and alerts read: the contract with the Prometheus sink.

Every series carries the labels ``engine`` (engine index as a string) and ``model_name``;
sidecar-level series (``iterscope_frames_undecodable_total`` and the like) have both empty.
"""

from __future__ import annotations

GAUGES = {
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
    "iterscope_engine_info",
    "iterscope_sidecar_lag_seconds",
    "iterscope_sidecar_up",
    "iterscope_sidecar_start_time_seconds",
    "iterscope_sink_last_write_timestamp_seconds",
}
COUNTERS = {
    "iterscope_iterations_total",
    "iterscope_prompt_tokens_total",
    "iterscope_prompt_tokens_cached_total",
    "iterscope_generation_tokens_total",
    "iterscope_preemptions_total",
    "iterscope_kv_blocked_iterations_total",
    "iterscope_prefix_cache_queries_total",
    "iterscope_prefix_cache_hits_total",
    "iterscope_requests_finished_total",
    "iterscope_records_received_total",
    "iterscope_records_dropped_total",
    "iterscope_engine_index_conflicts_total",
    "iterscope_frames_undecodable_total",
    "iterscope_frames_rejected_total",
    "iterscope_lane_disconnects_total",
    "iterscope_sink_errors_total",
    "iterscope_sink_lines_lost_total",
    "iterscope_otel_spans_dropped_total",
}
HISTOGRAMS = {
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
}
# Names as they appear in PromQL: histograms as their _bucket, _sum and _count series.
SERIES_NAMES = (
    GAUGES
    | COUNTERS
    | {f"{name}_{suffix}" for name in HISTOGRAMS for suffix in ("bucket", "sum", "count")}
)
